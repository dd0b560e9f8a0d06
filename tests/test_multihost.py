"""Beyond one host, on one machine: every "host" has its own loopback address. Two gateway
processes (127.0.1.1, 127.0.1.2) share a Redis server of their own (127.0.3.2) for the prefix
index, keys, limits and the ledger, and find the session stack's two real engines (127.0.2.1,
127.0.2.2) through SRV records of a dnsmasq on 127.0.3.1. A load client sends streams only to
gateways that answer /readyz, as a Kubernetes Service does. The drills: SIGTERM one gateway,
SIGKILL one, add and remove an engine in DNS, restart Redis.
"""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from multihost import (Engine, Fleet, drill_engines, drill_redis, drill_sigkill, drill_sigterm, failures,
                       port_base, reconcile)
from needs import missing
from polling import until

RESULTS: dict[str, dict] = {}


@pytest.fixture(scope="module")
def fleet(stack, tmp_path_factory):
    for binary, package in (("redis-server", "redis-server"), ("dnsmasq", "dnsmasq-base")):
        if not (shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")):
            missing(f"{binary} is not installed (apt-get install {package})")
    engines = [Engine(*url.removeprefix("http://").rsplit(":", 1)) for url in
               (stack.engines["standard"], stack.engines["fast"])]
    engines = [Engine(e.address, int(e.port)) for e in engines]
    hosts = Fleet(tmp_path_factory.mktemp("multihost"), engines, stack.model, stack.model_dir, port_base())
    try:
        hosts.start(engines)
        for i in range(2):
            until(lambda: hosts.serving(i) == {e.name for e in engines}, f"gateway {i + 1} routes to both engines")
        yield hosts
    finally:
        hosts.stop()
        for name, result in RESULTS.items():
            print(f"\n[multihost] {name}: " + ", ".join(f"{k}={v}" for k, v in result.items() if k != "timeline"))


def test_a_sessions_turns_land_on_one_engine_whichever_gateway_they_reach(fleet):
    """Cache-aware picks agree across gateways: the prefix index is shared through Redis."""
    urls = fleet.urls()
    placed: dict[str, set[str]] = {}
    for session in range(4):
        messages = [{"role": "system", "content": f"session {session} " + "shared context " * 60}]
        seen = placed.setdefault(f"s{session}", set())
        for turn in range(4):
            messages.append({"role": "user", "content": f"turn {turn} of session {session}"})
            r = httpx.post(urls[turn % 2] + "/v1/chat/completions", timeout=60,
                           headers={"x-session-id": f"multihost-s{session}"},
                           json={"model": "demo", "max_tokens": 8, "messages": messages})
            assert r.status_code == 200, r.text
            assert r.headers["x-yieldgate-gateway"] == f"gw-{turn % 2 + 1}"
            seen.add(r.headers["x-yieldgate-replica"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
            time.sleep(0.3)  # the index write reaches the other gateway through Redis
    assert all(len(replicas) == 1 for replicas in placed.values()), placed


def test_engines_added_and_removed_in_dns_under_load(fleet):
    a, b = fleet.engines
    drill = drill_engines(fleet, a, b)
    RESULTS["dns"] = drill.summary()
    assert failures(drill.served) == []
    removed, left = drill.numbers["removed_at"], drill.numbers["left_at"]
    # Streams that were on the removed engine when DNS dropped it finished there, without error.
    assert drill.numbers["in_flight_on_removed"] > 0
    assert [s for s in drill.served if s.replica == a.name and s.started < removed < s.ended]
    # Once both gateways stopped routing to it, no new request reached it.
    assert [s for s in drill.served if s.started > left and s.replica == a.name] == []
    assert [s for s in drill.served if s.started > left], "no load after the engine left"
    reconcile(fleet, drill.served)


def test_sigterm_one_gateway_under_load_drains_it(fleet):
    drill = drill_sigterm(fleet, victim=0)
    RESULTS["sigterm"] = drill.summary()
    assert drill.numbers["exit_code"] == 0
    assert failures(drill.served) == [], [s.detail for s in failures(drill.served)]
    url = fleet.urls()[0]
    signalled = drill.numbers["signalled_at"]
    # Streams in flight on it when it was signalled finished there.
    drained = [s for s in drill.served if s.gateway_url == url and s.started < signalled < s.ended]
    assert len(drained) >= 2 and all(s.ok for s in drained)
    # The other gateway took the traffic once it was gone.
    exited = signalled + drill.numbers["drain_s"]
    after = [s for s in drill.served if s.started > exited]
    assert after and {s.gateway for s in after} == {"gw-2"}
    by_gateway = reconcile(fleet, drill.served)
    assert by_gateway.get("gw-1", 0) > 0 and by_gateway.get("gw-2", 0) > 0


def test_sigkill_one_gateway_fails_only_its_requests_in_flight(fleet):
    drill = drill_sigkill(fleet, victim=1)
    RESULTS["sigkill"] = drill.summary()
    url, killed = fleet.urls()[1], drill.numbers["killed_at"]
    failed = failures(drill.served)
    # Only requests in flight on the killed gateway failed.
    assert all(s.gateway_url == url and s.started < killed for s in failed), [(s.gateway_url, s.detail) for s in failed]
    assert len(failed) <= drill.numbers["in_flight_at_kill"]
    assert [s for s in drill.served if s.started > killed and s.ok], "nothing was served after the kill"
    # Every acknowledged request is in the ledger once (the restarted gateway replayed its journal).
    reconcile(fleet, drill.served)


def test_redis_restarted_mid_run_both_gateways_keep_serving(fleet):
    drill = drill_redis(fleet)
    RESULTS["redis"] = drill.summary()
    assert failures(drill.served) == [], [s.detail for s in failures(drill.served)]
    down = [s for s in drill.served if drill.numbers["stopped_at"] < s.started < drill.numbers["started_at"]]
    assert {s.gateway for s in down} == {"gw-1", "gw-2"}, "both gateways served while Redis was down"
    reconcile(fleet, drill.served, timeout_s=90)
