"""Launched engines take LoRA adapters at run time: the fleet's `[fleet.lora]` becomes vLLM flags and
the variable that enables /v1/load_lora_adapter (the session stack's engines run with them:
tests/test_adapters.py)."""

from __future__ import annotations

import msgspec
import pytest

from yieldgate.serving.config import FleetConfig, LaunchSpec, LoraConfig, ReplicaConfig
from yieldgate.serving.launcher import engine_command, engine_env


def launched(fleet: FleetConfig) -> list[tuple[list[str], dict[str, str]]]:
    return [(engine_command("/m", fleet.model, fleet.block_size, r, fleet.lora), engine_env(r, fleet.lora))
            for r in fleet.replicas]


def test_demo_engines_run_with_lora_and_runtime_loading() -> None:
    for cmd, env in launched(FleetConfig()):
        at = cmd.index("--enable-lora")
        assert cmd[at:at + 5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
        assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_lora_can_be_sized_or_switched_off() -> None:
    fleet = msgspec.convert({"lora": {"max_loras": 4, "max_rank": 16}}, FleetConfig)
    cmd, _ = launched(fleet)[0]
    assert cmd[cmd.index("--max-loras") + 1] == "4" and cmd[cmd.index("--max-lora-rank") + 1] == "16"
    for cmd, env in launched(msgspec.convert({"lora": {"enabled": False}}, FleetConfig)):
        assert "--enable-lora" not in cmd and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env


def test_a_launch_spec_with_its_own_lora_flags_keeps_them() -> None:
    own = ReplicaConfig(name="r", launch=LaunchSpec(port=9, args=["--enable-lora", "--max-loras", "7"]))
    fleet = FleetConfig(replicas=[own])
    cmd, env = launched(fleet)[0]
    assert cmd.count("--enable-lora") == 1 and cmd[cmd.index("--max-loras") + 1] == "7"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


@pytest.mark.parametrize("bad", [{"max_loras": 0}, {"max_rank": 12}])
def test_sizes_vllm_would_refuse_are_config_errors(bad: dict) -> None:
    with pytest.raises((ValueError, msgspec.ValidationError)):
        msgspec.convert(bad, LoraConfig)
