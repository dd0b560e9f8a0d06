"""LoRA adapters on disk in the PEFT layout vLLM loads (`adapter_config.json` +
`adapter_model.safetensors`), and a seeded random adapter for the demo model.

Keys are PEFT's: `base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` ([rank, in])
and `...lora_B.weight` ([out, rank]); the update is `(alpha / rank) * B @ A`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_PREFIX = "base_model.model.model.layers"


def write_peft_adapter(out: Path, tensors: Mapping[str, "object"], rank: int, alpha: float,
                       target_modules: list[str], base_model: str = "") -> Path:
    """Write a PEFT adapter directory (tensors: PEFT key -> torch tensor). -> `out`."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha,
        "target_modules": sorted(target_modules), "lora_dropout": 0.0, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": base_model,
    }, indent=2))
    return out


def random_adapter(model_dir: Path, out: Path, seed: int, rank: int = 8, scale: float = 0.5,
                   modules: tuple[str, ...] = ATTENTION) -> Path:
    """A seeded random LoRA adapter for the Llama in `model_dir`: different seeds answer
    differently (B is non-zero, unlike a freshly initialised PEFT adapter)."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    kv = config.get("num_key_value_heads", heads) * head_dim
    shapes = {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
              "o_proj": (heads * head_dim, hidden)}  # (in, out)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module in modules:
            fan_in, fan_out = shapes[module]
            key = f"{_PREFIX}.{layer}.self_attn.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    return write_peft_adapter(out, tensors, rank, float(rank), list(modules), str(model_dir))
