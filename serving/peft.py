"""LoRA adapters on disk in the PEFT layout vLLM loads (`adapter_config.json` +
`adapter_model.safetensors`), the one-file form they are pushed in, its checks against the base
model, and a seeded random adapter for the demo model.

Keys are PEFT's: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([rank, in])
and `...lora_B.weight` ([out, rank]); the update is `(alpha / rank) * B @ A`.

A pushed adapter is one safetensors file whose metadata carries the PEFT config as JSON
(`adapter_config`): one body, one checksum, and a receiver can check every shape from its header
before it reads a tensor.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Mapping

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
_PREFIX = "base_model.model.model.layers"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
_DTYPES = {"F32", "F16", "BF16"}
CONFIG_METADATA = "adapter_config"


class InvalidAdapter(ValueError):
    """Not a LoRA adapter in PEFT form (unreadable, wrong keys or config)."""


class IncompatibleAdapter(InvalidAdapter):
    """A well-formed adapter that does not fit the base model or the engines' LoRA limits."""


def module_shapes(model_config: Mapping) -> dict[str, tuple[str, int, int]]:
    """Llama module -> (block, in features, out features), from the model's config.json."""
    hidden, heads = model_config["hidden_size"], model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or hidden // heads
    kv = model_config.get("num_key_value_heads", heads) * head_dim
    inter = model_config["intermediate_size"]
    return {"q_proj": ("self_attn", hidden, heads * head_dim), "k_proj": ("self_attn", hidden, kv),
            "v_proj": ("self_attn", hidden, kv), "o_proj": ("self_attn", heads * head_dim, hidden),
            "gate_proj": ("mlp", hidden, inter), "up_proj": ("mlp", hidden, inter),
            "down_proj": ("mlp", inter, hidden)}


def pack_adapter(tensors: Mapping[str, "object"], rank: int, alpha: float) -> bytes:
    """One safetensors file (PEFT keys -> tensors) with the PEFT config in its metadata."""
    from safetensors.torch import save

    modules = sorted({m.group(3) for k in tensors if (m := _KEY.match(k))})
    config = peft_config(rank, alpha, modules)
    return save({k: v.detach().contiguous() for k, v in tensors.items()},
                metadata={"format": "pt", CONFIG_METADATA: json.dumps(config)})


def peft_config(rank: int, alpha: float, modules: list[str], base_model: str = "") -> dict:
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
            "target_modules": sorted(modules), "lora_dropout": 0.0, "bias": "none",
            "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": base_model}


def check_packed_adapter(data: bytes, model_config: Mapping, max_rank: int) -> dict:
    """The PEFT config of a packed adapter, once its header shows it fits the base model (every
    key a LoRA A/B of a layer and module the model has, shapes [r, in] / [out, r], r <= max_rank)
    and every tensor parses. Raises InvalidAdapter / IncompatibleAdapter saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    header = _header(data)
    try:
        config = json.loads(header.pop("__metadata__", {}).get(CONFIG_METADATA, ""))
    except (ValueError, AttributeError):
        raise InvalidAdapter(f"no PEFT config: the safetensors metadata needs {CONFIG_METADATA!r} as JSON") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise InvalidAdapter("the PEFT config must say peft_type 'LORA'")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1 or not isinstance(config.get("lora_alpha"), (int, float)):
        raise InvalidAdapter("the PEFT config needs an integer r >= 1 and a number lora_alpha")
    if rank > max_rank:
        raise IncompatibleAdapter(f"rank {rank} is above the engines' --max-lora-rank {max_rank}")
    if not header:
        raise InvalidAdapter("the adapter has no tensors")
    shapes, layers = module_shapes(model_config), model_config["num_hidden_layers"]
    for key, info in header.items():
        m = _KEY.match(key)
        if m is None:
            raise InvalidAdapter(f"{key!r} is not a PEFT LoRA key (base_model.model.model.layers.N.<block>."
                                 "<module>.lora_A|lora_B.weight)")
        layer, block, module, half = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= layers or shapes.get(module, ("",))[0] != block:
            raise IncompatibleAdapter(f"{key!r}: the base model has no such layer or module")
        _, fan_in, fan_out = shapes[module]
        want = [rank, fan_in] if half == "A" else [fan_out, rank]
        if info.get("shape") != want or info.get("dtype") not in _DTYPES:
            raise IncompatibleAdapter(f"{key!r} is {info.get('dtype')} {info.get('shape')}; the base model "
                                      f"and r={rank} need {want} in one of {sorted(_DTYPES)}")
        if key.replace(f"lora_{half}", "lora_" + ("B" if half == "A" else "A")) not in header:
            raise InvalidAdapter(f"{key!r} has no lora_A/lora_B partner")
    try:
        load(data)  # offsets and sizes agree with the header
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise InvalidAdapter(f"the tensors do not parse: {exc}") from None
    return config


def _header(data: bytes) -> dict:
    if len(data) < 8:
        raise InvalidAdapter("not a safetensors file (too short)")
    (size,) = struct.unpack("<Q", data[:8])
    if size > len(data) - 8 or size > 100 << 20:
        raise InvalidAdapter("not a safetensors file (header length out of range)")
    try:
        header = json.loads(data[8:8 + size])
    except ValueError:
        raise InvalidAdapter("not a safetensors file (header is not JSON)") from None
    if not isinstance(header, dict):
        raise InvalidAdapter("not a safetensors file (header is not an object)")
    return header


def write_peft_adapter(out: Path, tensors: Mapping[str, "object"], rank: int, alpha: float,
                       target_modules: list[str], base_model: str = "") -> Path:
    """Write a PEFT adapter directory (tensors: PEFT key -> torch tensor). -> `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(peft_config(rank, alpha, target_modules, base_model),
                                                        indent=2))
    return out


def unpack_adapter(data: bytes, config: Mapping, out: Path) -> Path:
    """Write a checked packed adapter (check_packed_adapter) as a PEFT directory."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "adapter_model.safetensors").write_bytes(data)
    (out / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
    return out


def random_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, scale: float = 0.5,
                   modules: tuple[str, ...] = ATTENTION) -> Path:
    """A seeded random LoRA adapter for the Llama in `model_dir`: different seeds answer
    differently (B is non-zero, unlike a freshly initialised PEFT adapter)."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    shapes = module_shapes(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            block, fan_in, fan_out = shapes[module]
            key = f"{_PREFIX}.{layer}.{block}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    return write_peft_adapter(out, tensors, rank, float(rank), list(modules), str(model_dir))
