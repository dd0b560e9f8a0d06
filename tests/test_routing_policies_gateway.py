"""The session, least_loaded and round_robin policies through a real gateway whose one tier is
both demo engines; `x-yieldgate-replica` says which replica served each request.

A replica is made busy by a long stream through the same gateway: the gateway's own in-flight
count is part of a replica's load, and the tests read it before and after each short request to
know the stream was still running on its replica meanwhile.
"""

from __future__ import annotations

import contextlib
import secrets
import threading
from collections.abc import Iterator

import httpx

from test_chaos_faults import wait_until
from test_routing_gateway import names  # noqa: F401  (fixture: replica names unique to the test)

from yieldgate.cache.scorers import rendezvous
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig


def one_tier(stack, redis_url: str, names: list[str], policy: str) -> Config:
    replicas = [ReplicaConfig(name=names[0], tier="standard", url=stack.engines["standard"]),
                ReplicaConfig(name=names[1], tier="standard", url=stack.engines["fast"])]
    return Config(server=ServerConfig(redis_url=redis_url),
                  fleet=FleetConfig(model="demo", model_path=str(stack.model_dir), replicas=replicas,
                                    tiers={"standard": TierConfig(policy=policy)}, health_interval_s=0.5))


def served_by(url: str, *, session: str | None = None, user: str | None = None) -> str:
    body: dict = {"model": "demo", "max_tokens": 2, "messages": [{"role": "user", "content": "which replica?"}]}
    if user is not None:
        body["user"] = user
    headers = {"x-session-id": session} if session is not None else {}
    resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.headers["x-yieldgate-replica"]


@contextlib.contextmanager
def busy_stream(gw) -> Iterator[str]:
    """A long stream through the gateway, read as fast as it comes in a thread; yields the
    replica serving it once it is in flight there. Leaving closes it (the engine aborts it)."""
    stop, started = threading.Event(), threading.Event()
    where: list[str] = []

    def read() -> None:
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", gw.url + "/v1/chat/completions", json={
                    "model": "demo", "max_tokens": 4000, "ignore_eos": True, "stream": True,
                    "messages": [{"role": "user", "content": "keep talking"}]}) as resp:
                where.append(resp.headers["x-yieldgate-replica"])
                started.set()
                for _ in resp.iter_raw():
                    if stop.is_set():
                        break

    reader = threading.Thread(target=read)
    reader.start()
    try:
        assert started.wait(60), "the busy stream did not start"
        yield where[0]
    finally:
        stop.set()
        reader.join(120)


def while_busy(gw, count: int, send=None) -> tuple[str, list[str]]:
    """-> (the busy replica, who served `count` short requests each sent and answered while a long
    stream was in flight there). A stream can end before `count` answers on a fast engine: then
    another one is started (the answers so far are dropped), three times at most."""
    send = send or (lambda busy: served_by(gw.url))
    for _ in range(3):
        with busy_stream(gw) as busy:
            replica = gw.gateway.fleet.replicas[busy]
            where = []
            while len(where) < count and replica.inflight >= 1:
                answer = send(busy)
                if replica.inflight < 1:
                    break
                where.append(answer)
            if len(where) == count:
                return busy, where
    raise AssertionError(f"three long streams each ended before {count} short requests were answered")


def test_session_policy_keeps_each_session_on_its_rendezvous_home(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(one_tier(stack, redis_url, names, "session"))
    # Session ids whose rendezvous home is each replica: both replicas must serve someone.
    homes: dict[str, str] = {}
    while len(set(homes.values())) < 2 or len(homes) < 4:
        sid = "sess-" + secrets.token_hex(4)
        homes[sid] = max(names, key=lambda n: rendezvous(sid, n))
    for sid, home in homes.items():
        # Three in a row: a policy that rotates or balances load would move the second one.
        assert [served_by(gw.url, session=sid) for _ in range(3)] == [home] * 3, sid
        # The request's `user` field names the same session as the x-session-id header.
        assert served_by(gw.url, user=sid) == home
    assert set(homes.values()) == set(names)
    # A session stays home even when its home is the busier replica.
    busy, where = while_busy(gw, 2, lambda busy: served_by(
        gw.url, session=next(s for s, h in homes.items() if h == busy)))
    assert where == [busy] * 2


def test_least_loaded_avoids_the_busy_replica(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(one_tier(stack, redis_url, names, "least_loaded"))
    busy, where = while_busy(gw, 4)
    other = names[1] if busy == names[0] else names[0]
    assert where == [other] * 4
    # Idle again: both replicas serve (ties rotate by recent picks). The engines' scraped request
    # counts lag the stream's end by a scrape interval; until then the busy one still looks loaded.
    replicas = gw.gateway.fleet.replicas.values()
    wait_until(lambda: all(r.inflight == 0 and r.num_running + r.num_waiting == 0 for r in replicas), 30,
               "both replicas idle in the gateway's view")
    assert {served_by(gw.url) for _ in range(4)} == set(names)


def test_round_robin_rotates_over_a_busy_replica_too(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(one_tier(stack, redis_url, names, "round_robin"))
    busy, where = while_busy(gw, 4)
    other = names[1] if busy == names[0] else names[0]
    # Load does not matter: the busy replica takes every second request.
    assert where == [other, busy, other, busy]


def test_session_policy_without_a_session_falls_back_to_least_loaded(stack, gateway_factory, redis_url, names):
    gw = gateway_factory(one_tier(stack, redis_url, names, "session"))
    busy, where = while_busy(gw, 3)
    other = names[1] if busy == names[0] else names[0]
    assert where == [other] * 3
