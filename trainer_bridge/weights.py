"""Turning whatever a training loop holds into the (name, tensor) list vLLM's load_weights wants.

vLLM loads Hugging Face checkpoint names. Training wrappers add prefixes (DDP `module.`,
torch.compile `_orig_mod.`, FSDP `_fsdp_wrapped_module.`) and HF models carry tensors the
checkpoint does not (rotary caches, a tied lm_head), so those are stripped here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")
SKIPPED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")


def checkpoint_name(name: str) -> str:
    """`module._orig_mod.model.layers.0...` -> `model.layers.0...` (wrappers can nest)."""
    for prefix in WRAPPER_PREFIXES:
        name = name.replace(prefix, "")
    return name


@dataclass(frozen=True)
class WeightEntry:
    name: str
    tensor: torch.Tensor  # as the trainer holds it (any device, any dtype)
    dtype: torch.dtype  # dtype on the wire and in the engine's staging buffer

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.dtype.itemsize

    def materialize(self) -> torch.Tensor:
        """Contiguous CPU tensor in the wire dtype; a no-op for CPU tensors already in it."""
        t = self.tensor.detach()
        full = getattr(t, "full_tensor", None)  # FSDP DTensor: gather once, at send time
        if callable(full):
            t = full()
        return t.to(device="cpu", dtype=self.dtype).contiguous()


class WeightSet:
    """An ordered, name-mapped view of a model's weights; nothing is copied until it is sent."""

    def __init__(self, entries: list[WeightEntry]) -> None:
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError("duplicate parameter names after name mapping")
        self.entries = entries

    @classmethod
    def from_model(
        cls,
        model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
        dtype: torch.dtype | None = None,
        rename: Callable[[str], str | None] | None = None,
    ) -> WeightSet:
        """`rename` maps a (wrapper-stripped) name to the checkpoint name, or None to skip it."""
        if isinstance(model_or_state_dict, torch.nn.Module):
            module = model_or_state_dict
            tied = bool(getattr(getattr(module, "config", None), "tie_word_embeddings", False))
            items: Iterator[tuple[str, torch.Tensor]] = iter(module.state_dict().items())
        else:
            tied = False
            items = iter(model_or_state_dict.items())
        entries: list[WeightEntry] = []
        for raw, tensor in items:
            name = checkpoint_name(raw)
            if name.endswith(SKIPPED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            if rename is not None and (name := rename(name)) is None:
                continue
            if not tensor.is_floating_point():
                continue  # integer buffers (position ids, counters) are not weights
            entries.append(WeightEntry(name, tensor, dtype or tensor.dtype))
        return cls(entries)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def metadata(self) -> dict[str, list]:
        from .wire import dtype_name

        return {
            "names": [e.name for e in self.entries],
            "dtype_names": [dtype_name(e.dtype) for e in self.entries],
            "shapes": [list(e.shape) for e in self.entries],
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {e.name: e.materialize() for e in self.entries}

    @property
    def on_cuda(self) -> bool:
        return any(e.tensor.is_cuda for e in self.entries)
