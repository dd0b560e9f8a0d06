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
    assert env[engine_polling.ENV] == "50" and env[engine_polling.SPIN_ENV] == "300"
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


def test_register_replaces_the_ring_buffers_yield(ring_buffer_yield, monkeypatch):
    utils, shm_broadcast = ring_buffer_yield
    original = utils.sched_yield
    monkeypatch.delenv(engine_polling.ENV, raising=False)
    engine_polling.register()
    assert utils.sched_yield is original and shm_broadcast.sched_yield is original

    monkeypatch.setenv(engine_polling.ENV, "75")
    engine_polling.register()
    engine_polling.register()       # vLLM may load a plugin twice in one process
    assert shm_broadcast.sched_yield is utils.sched_yield is not original
    shm_broadcast.sched_yield()     # a first poll yields at once


def test_a_poll_loop_yields_for_its_spin_time_then_sleeps_each_poll():
    now, calls = [0.0], []

    def sleep(s):
        calls.append(("sleep", s))
        now[0] += s

    pause = engine_polling.poller(50e-6, 300e-6, clock=lambda: now[0], sleep=sleep,
                                  yield_=lambda: calls.append(("yield",)))
    for _ in range(3):              # 100 µs apart: one loop, still inside its 300 µs of spinning
        pause()
        now[0] += 100e-6
    assert calls == [("yield",)] * 3
    calls.clear()
    for _ in range(3):              # past the spin time: a 50 µs sleep each
        pause()
    assert calls == [("sleep", 50e-6)] * 3
    calls.clear()
    now[0] += 0.5                   # the next step's loop, after a pause longer than 1 ms
    pause()
    assert calls == [("yield",)]
