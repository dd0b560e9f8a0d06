"""The engine's way back to the weights it served before an update started.

Loading tensor by tensor while later chunks still stream means a late checksum failure finds
some layers already holding new weights. `ModelSnapshot` is taken before the update touches the
model and put back on any failure, so the engine serves exactly the old weights again.

What it keeps, per module: its attribute dict (shallow) and, per parameter/buffer, the tensor
object, its attributes and a copy of its bytes. Copies are only needed where vLLM's reload
writes in place into the old storage; anything processing *replaces* (on CPU, the oneDNN-packed
linear weights behind `layer.cpu_linear`, whose `weight` parameter is left empty) is kept by
reference, so the old and new versions are double-buffered until the update commits. Memory:
on CPU the embeddings, norms and lm_head (~2% of a Llama); on GPU one copy of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class _TensorState:
    tensor: torch.Tensor
    data: torch.Tensor  # the storage the tensor pointed at
    attrs: dict
    copy: torch.Tensor | None  # its bytes, when there are any


class ModelSnapshot:
    def __init__(self, model: torch.nn.Module) -> None:
        self._modules: list[tuple[torch.nn.Module, dict]] = []
        self._tensors: list[_TensorState] = []
        self.nbytes = 0
        seen: set[int] = set()
        with torch.no_grad():
            for module in model.modules():
                attrs = dict(module.__dict__)
                attrs["_parameters"] = dict(module._parameters)
                attrs["_buffers"] = dict(module._buffers)
                self._modules.append((module, attrs))
                for tensor in (*module._parameters.values(), *module._buffers.values()):
                    if tensor is None or id(tensor) in seen:
                        continue
                    seen.add(id(tensor))  # tied weights are saved once
                    copy = tensor.detach().clone() if tensor.numel() else None
                    self.nbytes += copy.nbytes if copy is not None else 0
                    self._tensors.append(_TensorState(tensor, tensor.data, dict(tensor.__dict__), copy))

    @torch.no_grad()
    def restore(self) -> None:
        """Every module back to its attributes, every tensor back to its storage and bytes."""
        for module, attrs in self._modules:
            module.__dict__.clear()
            module.__dict__.update(attrs)
            # The containers themselves were copied: fresh ones, so the snapshot stays reusable.
            module.__dict__["_parameters"] = dict(attrs["_parameters"])
            module.__dict__["_buffers"] = dict(attrs["_buffers"])
        for state in self._tensors:
            state.tensor.data = state.data
            state.tensor.__dict__.clear()
            state.tensor.__dict__.update(state.attrs)
            if state.copy is not None:
                state.data.copy_(state.copy)
