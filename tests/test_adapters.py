"""LoRA adapters as post-trained weights, against the session stack (both engines run with
`--enable-lora`): push through the gateway, serve under the adapter's name, bump the version under
concurrent load, roll back, refuse a corrupt version, delete.

The tests run in order and share one story (adapters `tl-a` and `tl-b`, random seeded rank-8
adapters of the demo model); the module deletes its adapters at the end.
"""

from __future__ import annotations

import concurrent.futures
import csv
import io
import threading
import time
from pathlib import Path

import uuid

import anthropic
import httpx
import openai
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from yieldgate.cache import BlockHashConfig, BlockHasher, BlockStored, Tokenizer, decode_batch, lora_extra_keys
from yieldgate.serving.peft import random_adapter

pytestmark = pytest.mark.engine

PROMPT = "Once upon a time"
NAME = "tl-a"


@pytest.fixture(scope="module")
def files(stack, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    made = {f"v{seed}": random_adapter(Path(stack.model_dir), root / f"v{seed}", seed=seed) for seed in (1, 2, 3)}
    corrupt = root / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((made["v1"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00\x01 not a safetensors file" * 100)
    made["corrupt"] = corrupt
    return made


@pytest.fixture(scope="module")
def story(admin) -> dict:
    state: dict = {}
    yield state
    for adapter in admin.get("/admin/adapters").json()["data"]:
        admin.delete(f"/admin/adapters/{adapter['name']}")


def complete(gateway: str, model: str, prompt: str = PROMPT, max_tokens: int = 12) -> httpx.Response:
    return httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def wait_unloaded(admin: httpx.Client, name: str, version: str, timeout_s: float = 60) -> dict:
    """The adapter's status once `version` is on no replica (a retired version goes when idle)."""
    deadline = time.monotonic() + timeout_s
    while True:
        doc = next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == name)
        if not any(version in held for held in doc["replicas"].values()):
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)


def test_push_needs_the_admin_credential(stack, files):
    r = httpx.post(stack.gateway_url + "/admin/adapters", json={"name": NAME, "version": "v1",
                                                                "path": str(files["v1"])})
    assert r.status_code == 401
    assert httpx.get(stack.gateway_url + "/admin/adapters").status_code == 401


def test_bad_pushes_get_a_clear_400(admin, files):
    for body in ({"name": "demo", "version": "v1", "path": str(files["v1"])},        # the base model's name
                 {"name": "a:fast", "version": "v1", "path": str(files["v1"])},      # the tier suffix
                 {"name": NAME, "version": "v/1", "path": str(files["v1"])},
                 {"name": NAME, "version": "v1", "path": "relative/dir"},
                 {"name": NAME, "version": "v1"},
                 {"name": NAME, "version": "v1", "path": str(files["v1"]), "source": "push"}):
        r = admin.post("/admin/adapters", json=body)
        assert r.status_code == 400 and r.json()["error"]["message"], (body, r.text)
    assert admin.post("/admin/adapters", content=b"{not json").status_code == 400
    assert admin.get("/admin/adapters").json()["data"] == []


def test_an_adapter_pushed_through_the_gateway_serves_under_its_name_on_every_replica(stack, admin, files, story, client):
    story["base"] = complete(stack.gateway_url, "demo").json()["choices"][0]["text"]
    r = admin.post("/admin/adapters", json={"name": NAME, "version": "v1", "source": "path", "path": str(files["v1"])})
    assert r.status_code == 201, r.text
    doc = r.json()
    assert doc["current"] == "v1" and doc["base"] == "demo" and doc["tiers"] == ["fast", "standard"]
    assert doc["replicas"] == {"fast-0": {"v1": "resident"}, "standard-0": {"v1": "resident"}}
    # The engines hold it under the version's own name.
    for url in stack.engines.values():
        served = {m["id"]: m.get("parent") for m in httpx.get(url + "/v1/models").json()["data"]}
        assert served.get(f"{NAME}@v1") == "demo"
    replicas = set()
    for model in (NAME, f"{NAME}:fast"):
        r = complete(stack.gateway_url, model)
        assert r.status_code == 200, r.text
        body = r.json()
        assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v1"
        assert body["system_fingerprint"] == f"yieldgate-{NAME}@v1"
        assert float(r.headers["x-yieldgate-cost-usd"]) > 0 and body["usage"]["cost"]
        assert body["choices"][0]["text"] != story["base"]  # the adapter changes the answer
        story[model, "v1"] = body["choices"][0]["text"]
        replicas.add(r.headers["x-yieldgate-replica"])
    assert replicas == {"standard-0", "fast-0"}
    # The official client sees it in /v1/models with its base as parent.
    cards = {m.id: m for m in client.models.list().data}
    assert cards[NAME].model_extra["parent"] == "demo"
    assert client.models.retrieve(NAME).model_extra["parent"] == "demo"
    chat = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.system_fingerprint == f"yieldgate-{NAME}@v1"
    ant = anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0)
    raw = ant.messages.with_raw_response.create(model=NAME + ":fast", max_tokens=4,
                                                messages=[{"role": "user", "content": "hi"}])
    assert raw.headers["x-yieldgate-weight-version"] == f"{NAME}@v1"
    assert raw.headers["x-yieldgate-replica"] == "fast-0" and raw.parse().type == "message"


def _collect_stored(endpoint: str, stop: threading.Event, out: list) -> None:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"kv-events")
    sock.connect(endpoint)
    try:
        while not stop.is_set():
            if sock.poll(200):
                _, _, payload = sock.recv_multipart()
                out.extend(e for e in decode_batch(payload).events if isinstance(e, BlockStored))
    finally:
        sock.close(linger=0)


def test_adapter_blocks_are_hashed_as_the_engine_hashes_them_and_routed_apart_from_the_base(stack, files):
    """The engine hashes an adapter request's blocks with the adapter's name and path: the gateway
    computes the same hashes (parity with the engine's KV events), so cache-aware routing predicts
    the adapter's cached blocks, never the base model's, and the other way round."""
    tok = Tokenizer.from_model_dir(Path(stack.model_dir))
    hasher = BlockHasher(BlockHashConfig(block_size=32, hash_seed="0"))
    keys = lora_extra_keys(f"{NAME}@v1", str(files["v1"]))
    stored: list[BlockStored] = []
    stop = threading.Event()
    collector = threading.Thread(target=_collect_stored, args=(stack.kv_events_endpoint, stop, stored))
    collector.start()
    try:
        for _ in range(5):  # PUB/SUB joins asynchronously: a first request can go unseen
            prompt = f"[{uuid.uuid4().hex}] " + " ".join(f"adapter block {i}" for i in range(60))
            first = complete(stack.gateway_url, NAME, prompt, max_tokens=1)  # standard tier: standard-0
            assert first.status_code == 200 and first.headers["x-yieldgate-replica"] == "standard-0"
            expected = hasher.hashes(tok.encode(prompt), None, keys)
            deadline = time.monotonic() + 8
            while not set(expected) <= {h for e in stored for h in e.block_hashes} and time.monotonic() < deadline:
                time.sleep(0.05)
            if set(expected) <= {h for e in stored for h in e.block_hashes}:
                break
        else:
            raise AssertionError("the engine's KV events never announced the adapter request's blocks")
    finally:
        stop.set()
        collector.join()
    announced = [h for e in stored for h in e.block_hashes]
    assert len(expected) >= 3 and [h for h in announced if h in set(expected)] == expected
    assert not set(hasher.hashes(tok.encode(prompt))) & set(announced)  # not the base model's hashes
    time.sleep(2.0)  # the gateway's own subscriber has the same events by now
    base = complete(stack.gateway_url, "demo", prompt, max_tokens=1)
    assert base.headers["x-yieldgate-replica"] == "standard-0"
    assert base.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert base.headers["x-yieldgate-predicted-cached-tokens"] == "0"
    again = complete(stack.gateway_url, NAME, prompt, max_tokens=1)
    cached = again.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 64
    assert int(again.headers["x-yieldgate-predicted-cached-tokens"]) == cached


def test_different_seeds_answer_differently(stack, admin, files, story):
    r = admin.post("/admin/adapters", json={"name": "tl-b", "version": "s2", "path": str(files["v2"])})
    assert r.status_code == 201, r.text
    for suffix in ("", ":fast"):
        other = complete(stack.gateway_url, "tl-b" + suffix).json()["choices"][0]["text"]
        assert other not in (story[NAME + suffix, "v1"], story["base"])
        story[NAME + suffix, "v2"] = other  # the weights of tl-a's v2 below, under another name
    assert admin.delete("/admin/adapters/tl-b").status_code == 200


def test_an_adapter_placed_on_one_tier_is_served_only_where_it_is_loaded(stack, admin, files):
    r = admin.post("/admin/adapters", json={"name": "tl-c", "version": "s3", "path": str(files["v3"]),
                                            "tiers": ["standard"]})
    assert r.status_code == 201, r.text
    assert r.json()["replicas"] == {"standard-0": {"s3": "resident"}}
    # Asked on the fast tier, it is served by the tier that holds it, and labelled so.
    r = complete(stack.gateway_url, "tl-c:fast")
    assert r.status_code == 200, r.text
    assert (r.headers["x-yieldgate-replica"], r.headers["x-yieldgate-tier"],
            r.headers["x-yieldgate-requested-tier"]) == ("standard-0", "standard", "fast")
    assert admin.post("/admin/adapters", json={"name": "tl-c", "version": "s4", "path": str(files["v3"]),
                                               "tiers": ["fast"]}).status_code == 409
    assert admin.post("/admin/adapters", json={"name": "tl-c", "version": "s4", "path": str(files["v3"]),
                                               "tiers": ["gpu"]}).status_code == 400
    assert admin.delete("/admin/adapters/tl-c").status_code == 200


def test_unknown_adapter_is_model_not_found_in_each_api_shape(stack, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert err.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-adapter")
    ant = anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as aerr:
        ant.messages.create(model="no-such-adapter:fast", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert aerr.value.body["type"] == "error" and aerr.value.body["error"]["type"] == "not_found_error"


def test_a_version_bump_under_concurrent_load_fails_nothing_and_mislabels_nothing(stack, admin, files, story):
    stop = threading.Event()
    results: list[tuple[str, int, str, str]] = []  # (model, status, version header, text)

    def load(model: str) -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                r = http.post(stack.gateway_url + "/v1/completions", json={
                    "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                results.append((model, r.status_code, r.headers.get("x-yieldgate-weight-version", ""), text))

    models = [NAME, NAME, f"{NAME}:fast", f"{NAME}:fast"]
    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        running = [pool.submit(load, m) for m in models]
        time.sleep(2.0)
        r = admin.post("/admin/adapters", json={"name": NAME, "version": "v2", "path": str(files["v2"])})
        time.sleep(2.0)
        stop.set()
        for f in running:
            f.result()
    assert r.status_code == 201, r.text
    failed = [x for x in results if x[1] != 200]
    assert not failed, failed[:3]
    by_version = {v: [x for x in results if x[2] == v] for v in (f"{NAME}@v1", f"{NAME}@v2")}
    assert by_version[f"{NAME}@v1"] and by_version[f"{NAME}@v2"], {v: len(x) for v, x in by_version.items()}
    assert len(results) == sum(len(x) for x in by_version.values())
    # Every answer is the text of the version its header names (greedy: one text per version).
    wrong = [x for x in results if x[3] != story[x[0], x[2].rsplit("@", 1)[1]]]
    assert not wrong, wrong[:3]
    doc = wait_unloaded(admin, NAME, "v1")
    assert doc["current"] == "v2" and doc["history"] == ["v1", "v2"]
    assert doc["replicas"] == {"fast-0": {"v2": "resident"}, "standard-0": {"v2": "resident"}}
    for url in stack.engines.values():
        served = {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}
        assert f"{NAME}@v1" not in served and f"{NAME}@v2" in served


def test_a_corrupt_version_is_refused_and_the_current_one_keeps_serving(stack, admin, files, story):
    r = admin.post("/admin/adapters", json={"name": NAME, "version": "v3", "path": str(files["corrupt"])})
    assert r.status_code == 422, r.text
    assert r.json()["error"]["code"] == "adapter_load_failed"
    r = admin.post("/admin/adapters", json={"name": NAME, "version": "v3", "path": str(files["v3"].parent / "absent")})
    assert r.status_code == 422, r.text
    doc = next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == NAME)
    assert doc["current"] == "v2" and [v["version"] for v in doc["versions"]] == ["v1", "v2"]
    assert doc["replicas"] == {"fast-0": {"v2": "resident"}, "standard-0": {"v2": "resident"}}
    for model in (NAME, f"{NAME}:fast"):
        r = complete(stack.gateway_url, model)
        assert r.status_code == 200 and r.headers["x-yieldgate-weight-version"] == f"{NAME}@v2"
        assert r.json()["choices"][0]["text"] == story[model, "v2"]


def test_rollback_restores_the_previous_version_in_one_call(stack, admin, story):
    r = admin.post(f"/admin/adapters/{NAME}/rollback")
    assert r.status_code == 200, r.text
    assert r.json()["current"] == "v1"
    for model in (NAME, f"{NAME}:fast"):
        r = complete(stack.gateway_url, model)
        assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v1"
        assert r.json()["choices"][0]["text"] == story[model, "v1"]
    doc = wait_unloaded(admin, NAME, "v2")
    assert doc["current"] == "v1" and doc["history"] == ["v1"]
    r = admin.post(f"/admin/adapters/{NAME}/rollback")
    assert r.status_code == 409 and r.json()["error"]["code"] == "adapter_conflict"


def test_the_ledger_records_adapter_and_version(stack, admin):
    deadline = time.monotonic() + 30
    while True:  # the journal reaches the store in batches
        mine = [r for r in csv.DictReader(io.StringIO(admin.get("/admin/ledger.csv").text)) if r["adapter"] == NAME]
        if {r["weight_version"] for r in mine} >= {f"{NAME}@v1", f"{NAME}@v2"} or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert {r["weight_version"] for r in mine} >= {f"{NAME}@v1", f"{NAME}@v2"}
    assert all(r["model"] == "demo" and float(r["cost_total"]) > 0 for r in mine if r["status"] == "ok")
    spend = admin.get("/admin/spend", params={"group_by": "adapter,weight_version"}).json()["rows"]
    versions = {r["group"]["weight_version"]: r for r in spend if r["group"]["adapter"] == NAME}
    assert set(versions) >= {f"{NAME}@v1", f"{NAME}@v2"}
    assert all(r["cost_total"] > 0 for r in versions.values())
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
        httpx.get(stack.gateway_url + "/metrics").text) for s in f.samples}
    for version in ("v1", "v2"):
        labels = (("adapter", NAME), ("weight_version", f"{NAME}@{version}"))
        assert samples[("yieldgate_adapter_requests_total", labels)] >= 1
        assert samples[("yieldgate_adapter_cost_usd_total", labels)] > 0


def test_a_deleted_adapter_is_unknown_and_unloaded(stack, admin):
    assert admin.delete(f"/admin/adapters/{NAME}").status_code == 200
    r = complete(stack.gateway_url, NAME)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert admin.delete(f"/admin/adapters/{NAME}").status_code == 404
    deadline = time.monotonic() + 60
    while any(m["id"].startswith(NAME + "@") for url in stack.engines.values()
              for m in httpx.get(url + "/v1/models").json()["data"]):
        assert time.monotonic() < deadline
        time.sleep(0.2)
