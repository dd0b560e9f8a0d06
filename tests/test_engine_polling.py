"""Launched engines poll their ring buffer with a short sleep, not a sched_yield() loop
(serving/engine_polling.py). What it changes on a host that also runs a gateway is shown by the
drain drills (tests/test_gateway_drain.py), which wait on the gateway while the engine decodes."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

from yieldgate.serving import engine_polling
from yieldgate.serving.config import LaunchSpec, ReplicaConfig
from yieldgate.serving.launcher import engine_env


def test_launched_engines_get_the_pause_unless_it_is_zero_or_their_env_says_otherwise():
    env = engine_env(ReplicaConfig(name="a", launch=LaunchSpec(port=1)))
    assert env[engine_polling.ENV] == "50"
    env = engine_env(ReplicaConfig(name="a", launch=LaunchSpec(port=1, poll_pause_us=0)))
    assert engine_polling.ENV not in env or env[engine_polling.ENV] == "0"
    env = engine_env(ReplicaConfig(name="a", launch=LaunchSpec(port=1, env={engine_polling.ENV: "200"})))
    assert env[engine_polling.ENV] == "200"


def test_it_is_a_vllm_general_plugin():
    plugins = {e.value for e in entry_points(group="vllm.general_plugins")}
    assert "yieldgate.serving.engine_polling:register" in plugins


@pytest.fixture
def ring_buffer_yield():
    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    before = utils.sched_yield, shm_broadcast.sched_yield
    yield utils, shm_broadcast
    utils.sched_yield, shm_broadcast.sched_yield = before


def test_register_replaces_the_ring_buffers_yield_with_a_sleep(ring_buffer_yield, monkeypatch):
    utils, shm_broadcast = ring_buffer_yield
    original = utils.sched_yield
    monkeypatch.delenv(engine_polling.ENV, raising=False)
    engine_polling.register()
    assert utils.sched_yield is original and shm_broadcast.sched_yield is original

    slept = []
    monkeypatch.setenv(engine_polling.ENV, "75")
    monkeypatch.setattr(engine_polling.time, "sleep", slept.append)
    engine_polling.register()
    engine_polling.register()       # vLLM may load a plugin twice in one process
    assert shm_broadcast.sched_yield is utils.sched_yield is not original
    shm_broadcast.sched_yield()
    assert slept == [75e-6]
