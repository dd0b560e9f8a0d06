"""What a pushed adapter must be before any engine sees it (serving/peft.py), what a trainer's
model becomes on the wire (trainer_bridge.adapter_state), and the outcome rule that promotes or
rolls back a canary (pricing/release_gate.py). No engine: the engine tests are test_adapter_push.py."""

from __future__ import annotations

import json
from decimal import Decimal

import pytest
import torch
from safetensors.torch import load, save

from yieldgate.pricing.release_gate import OutcomeRule, verdict
from yieldgate.pricing.report import SuccessRow
from yieldgate.serving.peft import (
    CONFIG_METADATA,
    IncompatibleAdapter,
    InvalidAdapter,
    check_packed_adapter,
    pack_adapter,
)
from yieldgate.trainer_bridge import adapter_state

MODEL = {"hidden_size": 128, "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "num_hidden_layers": 2}
KEY = "base_model.model.model.layers.{}.{}.{}.lora_{}.weight"


def lora(rank: int = 8, modules=(("self_attn", "q_proj", 128, 128), ("self_attn", "k_proj", 128, 64),
                                 ("mlp", "down_proj", 256, 128))) -> dict[str, torch.Tensor]:
    out = {}
    for layer in range(2):
        for block, module, fan_in, fan_out in modules:
            out[KEY.format(layer, block, module, "A")] = torch.randn(rank, fan_in)
            out[KEY.format(layer, block, module, "B")] = torch.randn(fan_out, rank)
    return out


def test_a_packed_adapter_carries_its_peft_config_and_passes_the_checks():
    tensors = lora()
    data = pack_adapter(tensors, rank=8, alpha=16.0)
    config = check_packed_adapter(data, MODEL, max_rank=8)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 8, 16.0)
    assert config["target_modules"] == ["down_proj", "k_proj", "q_proj"]
    assert all(torch.equal(load(data)[k], v) for k, v in tensors.items())


@pytest.mark.parametrize("damage, error, words", [
    (lambda t: save(t), InvalidAdapter, "no PEFT config"),
    (lambda t: b"\x00" * 4, InvalidAdapter, "too short"),
    (lambda t: b"\xff" * 64, InvalidAdapter, "header length"),
    (lambda t: pack_adapter({**t, "lm_head.weight": torch.zeros(2, 2)}, 8, 8.0), InvalidAdapter, "not a PEFT LoRA key"),
    (lambda t: pack_adapter({k: v for k, v in t.items() if "layers.1.mlp.down_proj.lora_B" not in k}, 8, 8.0),
     InvalidAdapter, "partner"),
    (lambda t: pack_adapter(lora(16), 16, 16.0), IncompatibleAdapter, "max-lora-rank 8"),
    (lambda t: pack_adapter({**t, KEY.format(0, "self_attn", "k_proj", "B"): torch.zeros(128, 8)}, 8, 8.0),
     IncompatibleAdapter, "need [64, 8]"),
    (lambda t: pack_adapter({**t, KEY.format(5, "self_attn", "q_proj", "A"): torch.zeros(8, 128),
                             KEY.format(5, "self_attn", "q_proj", "B"): torch.zeros(128, 8)}, 8, 8.0),
     IncompatibleAdapter, "no such layer"),
    (lambda t: pack_adapter({k: v.to(torch.int8) for k, v in t.items()}, 8, 8.0), IncompatibleAdapter, "I8"),
])
def test_what_is_refused_and_why(damage, error, words):
    with pytest.raises(error) as refused:
        check_packed_adapter(damage(lora()), MODEL, max_rank=8)
    assert words in str(refused.value)


def test_truncated_tensor_data_is_refused():
    data = pack_adapter(lora(), 8, 8.0)
    with pytest.raises(InvalidAdapter, match="do not parse"):
        check_packed_adapter(data[:-100], MODEL, max_rank=8)


def test_a_config_that_is_not_lora_is_refused():
    tensors = lora()
    data = save(tensors, metadata={CONFIG_METADATA: json.dumps({"peft_type": "PREFIX_TUNING", "r": 8})})
    with pytest.raises(InvalidAdapter, match="LORA"):
        check_packed_adapter(data, MODEL, max_rank=8)


def test_a_peft_model_goes_on_the_wire_under_peft_keys_with_its_rank_and_alpha():
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=32))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=12, target_modules=["q_proj", "v_proj"]))
    tensors, rank, alpha = adapter_state(model)
    assert (rank, alpha) == (4, 12.0) and len(tensors) == 8
    assert KEY.format(1, "self_attn", "v_proj", "B") in tensors
    assert check_packed_adapter(pack_adapter(tensors, rank, alpha), MODEL, max_rank=8)["r"] == 4
    # A LoRA written into a plain model's state dict ("model.layers...") gets PEFT's prefix.
    plain = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    assert adapter_state(plain)[0].keys() == tensors.keys() and adapter_state(plain)[1:] == (4, 4.0)
    with pytest.raises(ValueError, match="no LoRA tensors"):
        adapter_state({"model.norm.weight": torch.ones(128)})  # a base model has none


def row(graded: int, successes: int, spend: str) -> SuccessRow:
    r = SuccessRow(group={}, tasks_graded=graded, successes=successes, graded_spend_usd=Decimal(spend))
    r.success_rate = successes / graded if graded else None
    r.usd_per_success = Decimal(spend) / successes if successes else None
    return r


@pytest.mark.parametrize("stable, candidate, rule, expected", [
    (row(30, 15, "3"), row(5, 5, "0.5"), OutcomeRule(), "wait"),           # too few graded on the candidate
    (row(30, 15, "3"), row(30, 20, "3"), OutcomeRule(), "promote"),        # better and cheaper per success
    (row(30, 20, "3"), row(30, 15, "3"), OutcomeRule(), "rollback"),       # worse success rate
    (row(30, 20, "3"), row(30, 18, "2.8"), OutcomeRule(max_success_drop=0.1), "promote"),
    (row(30, 15, "3"), row(30, 15, "6"), OutcomeRule(), "rollback"),       # same rate, twice the $ per success
    (row(30, 15, "3"), row(30, 15, "3.2"), OutcomeRule(), "promote"),      # within the 1.1 cost ratio
    (row(30, 0, "3"), row(30, 0, "3"), OutcomeRule(), "rollback"),         # no success: never promoted
])
def test_the_outcome_rule(stable, candidate, rule, expected):
    decision, why = verdict(stable, candidate, rule)
    assert decision == expected, why
