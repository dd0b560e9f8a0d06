"""One contract for both front doors: the gateway's own ASGI proxy and the endpoint picker behind a
real Envoy run the same request pipeline (gateway/exchange.py), so the same billing and fault
tests pass through either, on the session stack's two real engines.

Each test runs twice (`door`: proxy, picker) and speaks plain HTTP to the door's URL; what the
door billed is read from its own ledger (SQLite in its data dir).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, Callable

import httpx
import msgspec
import pytest
import redis.asyncio as aioredis

from yieldgate.gateway.config import Config, PickerAdapter
from yieldgate.pricing import KeyStore, PriceBook, SQLiteStore, Usage
from yieldgate.serving.config import TierConfig
from yieldgate.serving.peft import random_adapter

from test_picker_envoy import ADMIN, PEPPER, both_engines, forget, ledger_record, mesh_factory, picker_mod  # noqa: F401

DOORS = ["proxy", "picker"]


@dataclass
class Door:
    name: str
    url: str
    data_dir: Path
    config: Config
    parts: Any                         # the Gateway or the EndpointPicker: fleet, adapters, pipeline
    call: Callable[[Any], Any]         # run a coroutine on the door's event loop

    def record(self, request_id: str):
        return ledger_record(self.data_dir, request_id)

    def settled(self, timeout: float = 10.0) -> bool:
        """Nothing counted in flight on any replica, no stream slot held."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not any(r.inflight for r in self.parts.fleet.replicas.values()) \
                    and not self.parts.pipeline.streams._open:
                return True
            time.sleep(0.05)
        return False


@pytest.fixture
def names(redis_url):
    tag = "fd" + secrets.token_hex(3)
    yield [f"{tag}-0", f"{tag}-1"]
    forget(redis_url, tag)


@pytest.fixture(params=DOORS)
def door_factory(request, stack, redis_url, names, tmp_path, gateway_factory):
    """-> make(adjust) : the door under test, its config changed by `adjust(config)` first."""
    if request.param == "picker":
        if picker_mod is None:
            pytest.skip("endpoint picker needs the `picker` extra")
        make_mesh = request.getfixturevalue("mesh_factory")

    made = []

    def make(adjust: Callable[[Config], None] = lambda c: None) -> Door:
        made.append(1)
        data_dir = tmp_path / f"{request.param}-{len(made)}"
        config = both_engines(stack, redis_url, names, data_dir)
        config.limits.max_body_bytes = 64 * 1024
        adjust(config)
        if request.param == "proxy":
            gw = gateway_factory(config)
            return Door("proxy", gw.url, data_dir, config, gw.gateway, lambda coro: _on_loop(gw, coro))
        mesh = make_mesh(config)
        return Door("picker", mesh.url, data_dir, config, mesh.picker.picker, mesh.picker.call)

    return make


def _on_loop(gw, coro, timeout: float = 60):
    """Run a coroutine on the embedded gateway's event loop (uvicorn's, in its thread)."""
    return asyncio.run_coroutine_threadsafe(coro, gw.gateway.loop_watch.loop).result(timeout)


def book(door: Door) -> PriceBook:
    return PriceBook(door.config.pricing)


def chat_body(content: str, **extra) -> dict:
    return {"model": "demo", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": content}], **extra}


def test_answers_are_billed_once_at_the_price_books_cost(door_factory):
    """Chat unary, streamed with usage, streamed without it, completions, Responses and Anthropic
    Messages: each one ledger record, `ok`, at the price book's cost of its usage; the client sees
    that cost."""
    door = door_factory()
    prices = book(door)
    ids: list[tuple[str, Decimal | None]] = []
    resp = httpx.post(door.url + "/v1/chat/completions", json=chat_body("unary question"), timeout=120)
    assert resp.status_code == 200, resp.text
    ids.append((resp.headers["x-request-id"], Decimal(str(resp.json()["usage"]["cost"]["total"]))))
    for usage in (True, False):
        body = chat_body(f"streamed question {usage}", stream=True)
        if usage:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", door.url + "/v1/chat/completions", json=body, timeout=120) as s:
            assert s.status_code == 200
            lines = [line for line in s.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        final = [msgspec.json.decode(line[6:]) for line in lines[:-1]]
        costs = [e["usage"]["cost"]["total"] for e in final if e.get("usage")]
        assert bool(costs) == usage  # usage the client did not ask for was billed, not shown
        ids.append((s.headers["x-request-id"], Decimal(str(costs[-1])) if costs else None))
    for path, body in (("/v1/completions", {"model": "demo", "prompt": "a completion", "max_tokens": 4,
                                             "temperature": 0}),
                       ("/v1/responses", {"model": "demo", "input": "a response", "max_output_tokens": 4,
                                          "temperature": 0, "store": False})):
        resp = httpx.post(door.url + path, json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        ids.append((resp.headers["x-request-id"], Decimal(str(resp.json()["usage"]["cost"]["total"]))))
    resp = httpx.post(door.url + "/v1/messages", timeout=120, json={
        "model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "anthropic question"}]})
    assert resp.status_code == 200, resp.text
    ids.append((resp.headers["x-request-id"], None))
    for request_id, shown in ids:
        rec = door.record(request_id)
        assert rec.status == "ok"
        expected = prices.cost("demo", rec.tier, Usage(rec.prompt_tokens, rec.cached_tokens,
                                                       rec.completion_tokens)).total
        assert rec.cost_total == expected > 0
        if shown is not None:
            assert shown == rec.cost_total
    assert door.settled()


def test_a_token_count_is_answered_and_not_billed(door_factory):
    """Anthropic's count_tokens: the engine's count, as many tokens as the same prompt bills
    (uncached plus cached), and no ledger record (nothing is generated)."""
    door = door_factory()
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    counted = httpx.post(door.url + "/v1/messages/count_tokens", timeout=60, json={"model": "demo", "messages": messages})
    assert counted.status_code == 200, counted.text
    resp = httpx.post(door.url + "/v1/messages", timeout=120, json={"model": "demo", "max_tokens": 2, "messages": messages})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert counted.json()["input_tokens"] == usage["input_tokens"] + usage["cache_read_input_tokens"] > 0
    door.record(resp.headers["x-request-id"])  # recorded after the count: the count would be in by now
    async def record_of_the_count():
        store = SQLiteStore(door.data_dir / "ledger.sqlite3")
        await store.open()
        try:
            return await store.get(counted.headers["x-request-id"])
        finally:
            await store.close()

    assert asyncio.run(record_of_the_count()) is None
    assert door.settled()


def test_an_abandoned_stream_is_billed_once_for_what_was_relayed(door_factory):
    """The client leaves after two events: one `aborted` record of the tokens relayed (fewer
    than asked), its slot and replica let go."""
    door = door_factory()
    for _ in range(3):  # an attempt whose engine had every token out before the client left is no test
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", door.url + "/v1/chat/completions", json=chat_body(
                    "Write a very long story.", max_tokens=2000, ignore_eos=True, stream=True)) as s:
                assert s.status_code == 200
                request_id = s.headers["x-request-id"]
                events = 0
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if events == 2:
                            break
        rec = door.record(request_id)
        if not (rec.status == "ok" and rec.completion_tokens == 2000):
            break
    assert rec.status == "aborted", rec
    assert 1 <= rec.completion_tokens < 2000 and rec.prompt_tokens > 0
    assert rec.cost_total == book(door).cost("demo", rec.tier, Usage(
        rec.prompt_tokens, rec.cached_tokens, rec.completion_tokens)).total > 0
    assert door.settled()


def test_refusals_are_the_routes_own_errors_and_bill_nothing(door_factory, redis_url):
    """413 past the body limit, 400 for bad JSON, 404 for an unknown model, 401 for a wrong key,
    429 over budget: the same status and code through either door, each before any engine."""
    door = door_factory()
    big = chat_body("x" * (door.config.limits.max_body_bytes + 1))
    resp = httpx.post(door.url + "/v1/chat/completions", json=big, timeout=30)
    assert (resp.status_code, resp.json()["error"]["code"]) == (413, "payload_too_large")
    resp = httpx.post(door.url + "/v1/messages", content=b"{not json", timeout=30)
    assert (resp.status_code, resp.json()["type"]) == (400, "error")  # Anthropic's shape on its route
    resp = httpx.post(door.url + "/v1/chat/completions", json=dict(chat_body("hi"), model="no-such"), timeout=30)
    assert (resp.status_code, resp.json()["error"]["code"]) == (404, "model_not_found")

    async def create_key():
        client = aioredis.Redis.from_url(redis_url)
        try:
            keys = KeyStore(client, pepper=PEPPER, prefix=door.config.pricing.limits.prefix)
            return await keys.create("front-doors", budget_usd="0.000000001", budget_period="total")
        finally:
            await client.aclose()

    created = asyncio.run(create_key())
    for secret, status, code in ((created.secret + "x", 401, "invalid_api_key"),
                                 (created.secret, 429, "insufficient_quota")):
        for stream in (False, True):
            resp = httpx.post(door.url + "/v1/chat/completions", json=chat_body("hi", stream=stream), timeout=30,
                              headers={"authorization": f"Bearer {secret}"})
            assert (resp.status_code, resp.json()["error"]["code"]) == (status, code)
    assert door.settled()


def test_a_replica_that_is_down_is_not_picked_and_none_left_is_a_503(door_factory):
    """One replica's engine does not listen: every request goes to the other one, billed once;
    with none left, the OpenAI-shaped 503 with a retry-after, for unary and streamed requests."""
    def one_dead(config: Config) -> None:
        config.fleet.replicas[0] = msgspec.structs.replace(
            config.fleet.replicas[0], url=f"http://127.0.0.1:{_dead_port()}", kv_events_endpoint="")

    door = door_factory(one_dead)
    alive = door.config.fleet.replicas[1].name
    dead = door.parts.fleet.replicas[door.config.fleet.replicas[0].name]
    deadline = time.monotonic() + 10
    while dead.healthy and time.monotonic() < deadline:  # Envoy connects where the picker says: no retry there
        time.sleep(0.1)
    for i in range(4):
        resp = httpx.post(door.url + "/v1/chat/completions", json=chat_body(f"question {i}"), timeout=60)
        assert resp.status_code == 200, resp.text
        rec = door.record(resp.headers["x-request-id"])
        assert (rec.replica, rec.status) == (alive, "ok")
    assert door.settled()

    def all_dead(config: Config) -> None:
        one_dead(config)
        del config.fleet.replicas[1]

    door = door_factory(all_dead)
    for stream in (False, True):
        resp = httpx.post(door.url + "/v1/chat/completions", json=chat_body("hi", stream=stream), timeout=60)
        assert resp.status_code == 503, resp.text
        assert resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "no_healthy_replica"
    assert door.settled()


def test_an_adapter_version_is_held_on_its_replica_while_its_request_runs(door_factory, stack, tmp_path):
    """A stream for an adapter counts on the version and on the replica it runs on (what keeps
    an eviction off it) until it ends, then on neither; it is served and billed as that version."""
    path = random_adapter(Path(stack.model_dir), tmp_path / "adapter", seed=11)
    name = "fd-" + secrets.token_hex(3)

    def fast_tier(config: Config) -> None:
        config.fleet.replicas[1] = msgspec.structs.replace(config.fleet.replicas[1], tier="fast")
        config.fleet.tiers = {"standard": TierConfig(policy="cache_aware", fallback="fast"),
                              "fast": TierConfig(policy="cache_aware")}
        config.picker.adapters = [PickerAdapter(name=name, version="v1", path=str(path), tiers=["fast"])]

    door = door_factory(fast_tier)
    adapters = door.parts.adapters
    slots = adapters.slots
    if door.name == "proxy":
        resp = httpx.post(door.url + "/admin/adapters", headers={"authorization": f"Bearer {ADMIN}"}, timeout=120,
                          json={"name": name, "version": "v1", "path": str(path), "tiers": ["fast"]})
        assert resp.status_code == 201, resp.text
    fast = door.parts.fleet.replicas[door.config.fleet.replicas[1].name]
    try:
        route = adapters.resolve(name)
        assert route is not None and slots.holds(route, fast)
        with httpx.stream("POST", door.url + "/v1/chat/completions", timeout=120, json=dict(
                chat_body("Write a long story.", max_tokens=200, ignore_eos=True, stream=True), model=name)) as s:
            assert s.status_code == 200
            request_id = s.headers["x-request-id"]
            lines = s.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            assert (slots.running(route), slots.running(route, fast)) == (1, 1)
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        rec = door.record(request_id)
        assert (rec.status, rec.adapter, rec.weight_version, rec.replica) == ("ok", name, f"{name}@v1", fast.name)
        assert door.settled()
        assert (slots.running(route), slots.running(route, fast)) == (0, 0)
    finally:
        door.call(adapters.remove(name))
        deadline = time.monotonic() + 30
        while name in httpx.get(stack.engines["fast"] + "/v1/models", timeout=10).text \
                and time.monotonic() < deadline:
            time.sleep(0.2)


def _dead_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
