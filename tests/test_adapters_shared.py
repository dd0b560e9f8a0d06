"""LoRA adapters placed on demand and shared by two gateways: two embedded gateways over one of the
session stack's engines share a Redis of their own (the adapter registry and residency live
there). An adapter loaded through one is served by the other; a replica with its `max_loras` slots
full unloads its least recently used idle adapter and the request still succeeds; an adapter with a
request in flight through the other gateway is never the one unloaded; an adapter that cannot load
is a 503 in OpenAI shape.

The tests run in order and share one story (adapters `sh-a` ... `sh-d`, placed `{"replicas": 1}`).
"""

from __future__ import annotations

import shutil
import time
from decimal import Decimal
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from multihost import RedisServer
from streams import StreamReader
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import EmbeddedGateway
from yieldgate.pricing import PriceBook, Usage
from yieldgate.pricing.config import AdapterPrice
from yieldgate.serving.config import FleetConfig, LoraConfig, ReplicaConfig
from yieldgate.serving.peft import random_adapter

pytestmark = pytest.mark.engine

ADMIN = "shared-adapters-admin"
ON_DEMAND = {"replicas": 1}


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    import os

    port = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 412
    server = RedisServer(tmp_path_factory.mktemp("adapters-redis"), "127.0.3.4", port)
    if server.binary is None:
        from needs import missing
        missing("redis-server is not installed")
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateways(stack, redis_server, tmp_path_factory):
    """Two gateways, one engine (the stack's standard one, two adapter slots)."""
    started = []
    for i in (1, 2):
        config = Config(server=ServerConfig(admin_token=ADMIN, redis_url=redis_server.url, instance_id=f"gw-{i}",
                                            data_dir=str(tmp_path_factory.mktemp(f"gw-{i}"))),
                        fleet=FleetConfig(model=stack.model, health_interval_s=0.5,
                                          replicas=[ReplicaConfig(name="eng-0", url=stack.engines["standard"])],
                                          lora=LoraConfig(max_loras=2, sync_s=0.25, load_wait_s=60,
                                                          metric_series=2)))
        config.pricing.adapters = {"sh-a": AdapterPrice(surcharge=Decimal("0.5"))}
        started.append(EmbeddedGateway(config))
    yield started
    for gw in started:
        gw.stop()


@pytest.fixture(scope="module")
def files(stack, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("shared-adapters")
    return {name: random_adapter(Path(stack.model_dir), root / name, seed=seed)
            for seed, name in enumerate(("sh-a", "sh-b", "sh-c", "sh-d"), start=11)}


def admin(gw: EmbeddedGateway) -> httpx.Client:
    return httpx.Client(base_url=gw.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})


def listing(gw: EmbeddedGateway) -> dict[str, dict]:
    with admin(gw) as c:
        return {a["name"]: a for a in c.get("/admin/adapters").json()["data"]}


def push(gw: EmbeddedGateway, files: dict[str, Path], name: str) -> httpx.Response:
    with admin(gw) as c:
        return c.post("/admin/adapters", json={"name": name, "version": "v1", "path": str(files[name]),
                                               "placement": ON_DEMAND})


def complete(gw: EmbeddedGateway, model: str, max_tokens: int = 8, **extra) -> httpx.Response:
    return httpx.post(gw.url + "/v1/completions", timeout=120, json={
        "model": model, "prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, **extra})


def engine_holds(stack) -> set[str]:
    data = httpx.get(stack.engines["standard"] + "/v1/models").json()["data"]
    return {m["id"] for m in data if m["id"].startswith("sh-")}


def test_an_adapter_loaded_through_one_gateway_is_served_by_the_other(gateways, files, stack):
    one, two = gateways
    r = push(one, files, "sh-a")
    assert r.status_code == 201, r.text
    assert r.json()["placement"] == ON_DEMAND and r.json()["replicas"] == {"eng-0": {"v1": "resident"}}
    # Both gateways show the same registry and residency, read from Redis.
    assert listing(two)["sh-a"] == listing(one)["sh-a"]
    answers = []
    for gw in (two, one):
        r = complete(gw, "sh-a")
        assert r.status_code == 200, r.text
        assert r.headers["x-yieldgate-weight-version"] == "sh-a@v1" and r.headers["x-yieldgate-replica"] == "eng-0"
        answers.append(r.json()["choices"][0]["text"])
    assert answers[0] == answers[1]
    assert engine_holds(stack) == {"sh-a@v1"}
    # A version that exists is refused by the other gateway too: one registry.
    again = push(two, files, "sh-a")
    assert again.status_code == 409 and again.json()["error"]["code"] == "adapter_conflict"


def test_slots_full_unloads_the_least_recently_used_adapter_and_the_request_succeeds(gateways, files, stack):
    one, two = gateways
    r = push(one, files, "sh-b")
    assert r.status_code == 201, r.text
    assert complete(one, "sh-b").status_code == 200   # sh-b used after sh-a: sh-a is least recent
    r = push(one, files, "sh-c")
    assert r.status_code == 201, r.text
    assert engine_holds(stack) == {"sh-b@v1", "sh-c@v1"}
    assert listing(two)["sh-a"]["replicas"] == {}      # unloaded, and both gateways know it
    # A request for the unloaded one, through the other gateway, loads it again (unloading sh-b,
    # now the least recently used) and succeeds.
    r = complete(two, "sh-a")
    assert r.status_code == 200, r.text
    assert r.headers["x-yieldgate-weight-version"] == "sh-a@v1"
    assert engine_holds(stack) == {"sh-a@v1", "sh-c@v1"}
    shown = listing(one)
    assert shown["sh-a"]["replicas"] == {"eng-0": {"v1": "resident"}} and shown["sh-b"]["replicas"] == {}
    assert listing(two) == shown


def test_an_adapter_with_a_request_in_flight_elsewhere_is_never_unloaded(gateways, stack):
    one, two = gateways
    assert complete(one, "sh-c").status_code == 200
    # A long stream on sh-a through gateway two; sh-c is used after it, so sh-a is the least
    # recently used, yet busy: loading sh-b through gateway one must unload sh-c instead.
    # Read by a process of its own (tests/streams.py) while this test loads the other adapters.
    body = {"model": "sh-a", "prompt": "Once", "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with StreamReader(two.url + "/v1/completions", [body]) as reader:
        reader.wait_started(60)
        assert complete(one, "sh-c").status_code == 200     # sh-c more recent than sh-a
        r = complete(one, "sh-b")
        assert r.status_code == 200, r.text
        assert not reader.any_ended(), "the stream ended before the slot was needed; make it longer"
        holds_meanwhile = engine_holds(stack)
        (stream,) = reader.results(300)
    assert holds_meanwhile == {"sh-a@v1", "sh-b@v1"}
    assert stream.error == "" and stream.done and len(stream.events) > 100, (stream.error, len(stream.events))


def test_an_adapter_that_cannot_load_is_a_503_in_openai_shape(gateways, files, stack):
    one, two = gateways
    r = push(two, files, "sh-d")
    assert r.status_code == 201, r.text
    assert complete(one, "sh-a").status_code == 200     # sh-a and sh-d resident: sh-b went
    assert complete(one, "sh-b").status_code == 200     # sh-d (least recent) went
    assert "sh-d@v1" not in engine_holds(stack)
    shutil.rmtree(files["sh-d"])                         # its files are gone: it cannot load again
    client = openai.OpenAI(base_url=one.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.completions.create(model="sh-d", prompt="hi", max_tokens=2)
    assert err.value.status_code == 503 and err.value.code == "adapter_unavailable"
    assert "sh-d@v1" in err.value.message
    assert complete(two, "sh-a").status_code == 200     # the others still serve


def test_adapters_are_priced_with_their_surcharge_and_their_series_are_capped(gateways):
    one, _ = gateways
    book = PriceBook()
    for model, factor in (("sh-a", Decimal("1.5")), ("sh-b", 1), ("demo", 1)):
        r = complete(one, model, max_tokens=6, ignore_eos=True)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        base = book.cost("demo", "standard", Usage(usage["prompt_tokens"], cached, usage["completion_tokens"]))
        assert Decimal(str(usage["cost"]["total"])) == base.total * factor, (model, usage)
    complete(one, "sh-c")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
        httpx.get(one.url + "/metrics").text) for s in f.samples if s.name == "yieldgate_adapter_requests_total"}
    adapters = {dict(labels)["adapter"] for _, labels in samples}
    assert len(adapters - {"other"}) == 2 and "other" in adapters, adapters


def test_a_deleted_adapter_is_unknown_to_both_gateways_and_unloaded(gateways, stack):
    one, two = gateways
    for name in ("sh-a", "sh-b", "sh-c", "sh-d"):
        with admin(one) as c:
            assert c.delete(f"/admin/adapters/{name}").status_code == 200
    deadline = time.monotonic() + 30
    while listing(two) or engine_holds(stack):
        assert time.monotonic() < deadline, (listing(two), engine_holds(stack))
        time.sleep(0.2)
    r = complete(two, "sh-a")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert listing(one) == {}
