"""The one-call push (`push(gateway=URL)` -> `POST /admin/weights/push`) into engines that do NOT
run the `yieldgate` weight-transfer backend: the gateway cannot fan the stream out, so it receives
the trainer's stream itself (its relay intake), writes the checkpoint, and rolls it in by
`/collective_rpc reload_weights` on each drained replica.

Starts two plugin-less engines of its own (one tier, so a rolling swap always leaves one serving)
behind an in-process gateway; no session stack.
"""

from __future__ import annotations

import csv
import io
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engines import start_engine, stop_engine, wait_healthy
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import EmbeddedGateway
from yieldgate.serving.config import FleetConfig, ReplicaConfig
from yieldgate.trainer_bridge import push
from yieldgate.trainer_bridge.engine_client import EngineClient

pytestmark = pytest.mark.engine

PORTS = [int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 303 + i for i in range(2)]
ADMIN = "relay-admin-" + os.urandom(4).hex()
PROMPT = "Once upon a time"
NEW = "relay-1"
TEXTS: dict[str, str] = {}  # version -> greedy text, remembered across this module's tests
LABELS: dict[str, str] = {}  # request id -> x-yieldgate-weight-version of its answer, during the push
CACHED = (f"[cached before push {os.urandom(4).hex()}] " + " ".join(f"verse {i} of the old weights' song" for i in range(40)))


@pytest.fixture(scope="module")
def relayed_fleet(tmp_path_factory, redis_url):
    """-> (gateway URL, {replica name: engine URL}, model dir, the gateway): two engines without
    the plugin, and no KV events: what the gateway knows of their caches comes from routing."""
    from yieldgate.serving.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    home = tmp_path_factory.mktemp("relay-home")
    names = [f"relay-{i}" for i in range(len(PORTS))]
    urls = {name: f"http://127.0.0.1:{port}" for name, port in zip(names, PORTS)}
    procs = [start_engine(model_dir, port, home / f"{name}.log", plugin=False)
             for name, port in zip(names, PORTS)]
    gateway = None
    try:
        for (name, url), proc in zip(urls.items(), procs):
            wait_healthy(url, proc, home / f"{name}.log")
        with pytest.MonkeyPatch.context() as env:
            env.setenv("YIELDGATE_HOME", str(home))  # checkpoints and ledger stay here
            config = Config(
                server=ServerConfig(admin_token=ADMIN, redis_url=redis_url),
                fleet=FleetConfig(model="demo", model_path=str(model_dir), health_interval_s=0.5,
                                  replicas=[ReplicaConfig(name=n, tier="standard", url=u)
                                            for n, u in urls.items()]))
            gateway = EmbeddedGateway(config)
            yield gateway.url, urls, Path(model_dir), gateway
    finally:
        if gateway is not None:
            gateway.stop()
        for proc in procs:
            stop_engine(proc)


def admin_get(gateway: str) -> dict:
    return httpx.get(gateway + "/admin/weights", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=60).json()


def complete(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})


def engine_state(url: str) -> tuple[str, str]:
    """-> (the version the engine itself reports, its greedy text): asked directly, not through
    the gateway, so neither comes from the gateway's labels."""
    with EngineClient(url, 60.0) as client:
        version = client.weight_version()
    return version, complete(url).json()["choices"][0]["text"]


def cached_prompt_hashes(gw: EmbeddedGateway) -> list:
    routing = gw.gateway.routing
    return routing.routers["standard"].hasher.hashes(routing.tokenizer.encode(CACHED))


def ask_cached(gateway: str) -> httpx.Response:
    r = httpx.post(gateway + "/v1/completions", timeout=120,
                   json={"model": "demo", "prompt": CACHED, "max_tokens": 1})
    assert r.status_code == 200, r.text
    return r


def test_one_call_push_into_engines_without_the_plugin_is_relayed_and_reloaded(relayed_fleet):
    gateway, engines, model_dir, gw = relayed_fleet
    for url in engines.values():
        with EngineClient(url, 60.0) as client:
            assert client.transfer_backend() is None  # really no weight-transfer backend
    before = {name: engine_state(url) for name, url in engines.items()}
    assert {v for v, _ in before.values()} == {"default"}
    # The gateway asked the serving dtype once a replica was up, before any push needed it (an
    # engine's first /server_info collects its environment: seconds, >10 on a busy box).
    deadline = time.monotonic() + 120
    while admin_get(gateway)["dtype"] is None and time.monotonic() < deadline:
        time.sleep(0.5)
    assert admin_get(gateway)["dtype"] == "bfloat16"
    base_text = before["relay-0"][1]
    assert {t for _, t in before.values()} == {base_text}
    TEXTS["default"] = base_text

    # A prompt cached before the push: the gateway predicts its hit from the prefix index.
    ask_cached(gateway)
    home = ask_cached(gateway)
    assert int(home.headers["x-yieldgate-predicted-cached-tokens"]) >= 32 * 8
    hashes = cached_prompt_hashes(gw)
    assert home.headers["x-yieldgate-replica"] in gw.gateway.routing.index.match(hashes)

    base = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(21)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}

    seen: list[tuple[int, str, str, str]] = []  # (status, replica, version label, text)
    seen_at: list[float] = []  # when each of `seen` came back
    errors: list[str] = []  # a timeout or dropped connection: a failed request, not a dead thread
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                try:
                    r = http.post(gateway + "/v1/completions", json={
                        "model": "demo", "prompt": PROMPT, "max_tokens": 4, "temperature": 0})
                    text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]
                except Exception as exc:
                    errors.append(f"{type(exc).__name__}: {exc}")
                    continue
                seen.append((r.status_code, r.headers.get("x-yieldgate-replica", ""),
                             r.headers.get("x-yieldgate-weight-version", ""), text))
                LABELS[r.headers.get("x-request-id", "")] = r.headers.get("x-yieldgate-weight-version", "")
                seen_at.append(time.monotonic())

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        push_started = time.monotonic()
        report = push(new_weights, NEW, gateway=gateway, token=ADMIN, progress=False)
        push_ended = time.monotonic()
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not any(t.is_alive() for t in threads), "a load thread did not finish"
    during_push = sum(push_started < t < push_ended for t in seen_at)

    state = admin_get(gateway)["rollout"]
    t0 = state["started_at"]
    print(f"\n[relayed] push {report.seconds:.1f}s, {len(seen)} requests ({during_push} during the push); timeline: "
          + ", ".join(f"{e['event']}{'/' + e['replica'] if e['replica'] else ''}@{e['t'] - t0:.1f}"
                      for e in state["timeline"]))
    assert report.version == NEW
    assert len(report.engines) == 1  # the gateway's own intake: nothing streamed to an engine
    assert state["state"] == "succeeded" and state["version"] == NEW, state.get("reason")
    timeline = state["timeline"]
    assert "relayed by the gateway" in timeline[0]["detail"], timeline[0]
    events = [e["event"] for e in timeline]
    assert "staging" not in events and "staged" not in events
    # Every replica took the checkpoint by reload, was verified, and came back.
    updated = {e["replica"]: e["detail"] for e in timeline if e["event"] == "updated"}
    assert updated == {name: "reload" for name in engines}, updated
    assert {e["replica"] for e in timeline if e["event"] == "verified"} == set(engines)

    # The served version advanced on every replica: as the engines report it and as the gateway
    # labels it; and the outputs changed, the same way on both.
    after = {name: engine_state(url) for name, url in engines.items()}
    assert {v for v, _ in after.values()} == {NEW}, after
    new_text = after["relay-0"][1]
    assert new_text != base_text
    assert {t for _, t in after.values()} == {new_text}
    replicas = admin_get(gateway)["replicas"]
    assert {n: r["weight_version"] for n, r in replicas.items()} == {n: NEW for n in engines}
    assert all(r["admitted"] and r["healthy"] for r in replicas.values())

    # No request failed during the rollout, and each answer's label names the weights that made it.
    assert errors == [], errors[:5]
    assert during_push > 0, "no request completed while the push was swapping weights"
    failed = [s for s in seen if s[0] != 200]
    assert not failed, failed[:5]
    expected = {"base": base_text, NEW: new_text}
    assert {s[2] for s in seen} <= set(expected)
    wrong = [s for s in seen if s[3] != expected[s[2]]]
    assert not wrong, wrong[:5]
    r = complete(gateway)
    assert r.headers["x-yieldgate-weight-version"] == NEW
    assert r.json()["choices"][0]["text"] == new_text

    # Each engine reset its prefix cache with the new weights: the index holds nothing it knew
    # before the push, and the prompt cached then is predicted to miss.
    assert gw.gateway.routing.index.match(hashes) == {}
    assert int(ask_cached(gateway).headers["x-yieldgate-predicted-cached-tokens"]) == 0


def test_ledger_and_success_report_name_the_weights_of_each_answer(relayed_fleet):
    gateway, engines, _model_dir, _gw = relayed_fleet
    auth = {"Authorization": f"Bearer {ADMIN}"}
    assert set(LABELS.values()) == {"base", NEW}, "the push test's load saw both versions"
    deadline = time.monotonic() + 30
    while True:
        resp = httpx.get(gateway + "/admin/ledger.csv", headers=auth, timeout=60)
        rows = {r["request_id"]: r for r in csv.DictReader(io.StringIO(resp.text))}
        if set(LABELS) <= set(rows) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert set(LABELS) <= set(rows)
    # The ledger names the weights that made each answer, as its response header did.
    assert {rid: rows[rid]["weight_version"] for rid in LABELS} == LABELS
    # Grade one answer of each version: the success report splits by weight version.
    by_version = {}
    for rid, version in LABELS.items():
        by_version.setdefault(version, rid)
    for version, rid in by_version.items():
        fb = httpx.post(gateway + "/v1/feedback", json={"request_id": rid, "passed": version == NEW}, timeout=10)
        assert fb.status_code == 200, fb.text
    report = httpx.get(gateway + "/admin/success", params={"group_by": "weight_version"}, headers=auth,
                       timeout=30).json()
    rows_by_version = {r["group"]["weight_version"]: r for r in report["rows"]}
    assert rows_by_version[NEW]["requests"] >= sum(v == NEW for v in LABELS.values())
    assert (rows_by_version[NEW]["tasks_graded"], rows_by_version[NEW]["successes"]) == (1, 1)
    assert (rows_by_version["base"]["tasks_graded"], rows_by_version["base"]["successes"]) == (1, 0)


def test_rollback_after_a_relayed_push_restores_base(relayed_fleet):
    gateway, engines, _model_dir, _gw = relayed_fleet
    resp = httpx.post(gateway + "/admin/weights/rollback", json={}, timeout=300,
                      headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["rollout"]["version"] == "base"
    with ThreadPoolExecutor(len(engines)) as pool:
        after = dict(zip(engines, pool.map(engine_state, engines.values())))
    assert after == {name: ("default", TEXTS["default"]) for name in engines}
    replicas = admin_get(gateway)["replicas"]
    assert {r["weight_version"] for r in replicas.values()} == {"base"}
