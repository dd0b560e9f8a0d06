"""An engine of the running demo stack is SIGKILLed under concurrent load, once per tier.

Only requests in flight on it at the kill may fail; the rest are served by the other tier,
labelled and priced as that tier, with the requested tier in the ledger; health says `degraded`
meanwhile; the supervisor restarts the engine and the gateway puts the fleet's current weight
version back on it before it takes traffic again. Runs late (file name): it restarts the stack's
engines and leaves them on base weights.
"""

from __future__ import annotations

import csv
import io
import os
import signal
import threading
import time
from decimal import Decimal
from pathlib import Path

import httpx
import psutil
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file

from yieldgate.gateway.config import load_config
from yieldgate.pricing import PriceBook, Usage
from yieldgate.serving.peft import random_adapter
from yieldgate.trainer_bridge import write_checkpoint

pytestmark = pytest.mark.engine

PROMPT = "Once upon a time"
VERSION = "crash-1"
CLIENTS = 4
MODEL = {"standard": "demo", "fast": "demo:fast"}
REPLICA = {"standard": "standard-0", "fast": "fast-0"}
RESTART_BUDGET_S = 600   # the supervisor's restart plus the engine's start-up, worst case here


@pytest.fixture(scope="module")
def admin(stack):
    with stack.admin_client() as client:
        yield client
        client.post("/admin/weights/rollback", json={"to": "base"})


@pytest.fixture(scope="module")
def pushed(stack, admin, tmp_path_factory) -> dict[str, str]:
    """The whole fleet on VERSION (the version a restarted engine must come back on); -> the
    greedy text each tier answers PROMPT with on it."""
    base = load_file(str(Path(stack.model_dir) / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    ckpt = write_checkpoint({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()},
                            stack.model_dir, tmp_path_factory.mktemp("crash") / VERSION)
    state = admin.post("/admin/weights", json={"version": VERSION, "source": {"checkpoint": str(ckpt)},
                                               "mode": "rolling", "wait": True}).json()["rollout"]
    assert state["state"] == "succeeded", state
    texts = {}
    for tier, model in MODEL.items():
        resp = complete(stack.gateway_url, model)
        assert resp.status_code == 200 and resp.headers["x-yieldgate-weight-version"] == VERSION, resp.text
        texts[tier] = resp.json()["choices"][0]["text"]
    return texts


ADAPTER = "crash-a"


@pytest.fixture(scope="module")
def adapter(stack, admin, pushed, tmp_path_factory) -> dict[str, str]:
    """A LoRA adapter on both engines (lost by an engine that restarts); -> its text per tier."""
    path = random_adapter(Path(stack.model_dir), tmp_path_factory.mktemp("crash-adapter") / "v1", seed=11)
    r = admin.post("/admin/adapters", json={"name": ADAPTER, "version": "v1", "path": str(path)})
    assert r.status_code == 201, r.text
    texts = {tier: complete(stack.gateway_url, ADAPTER + model.removeprefix("demo")).json()["choices"][0]["text"]
             for tier, model in MODEL.items()}
    assert texts != pushed
    yield texts
    admin.delete(f"/admin/adapters/{ADAPTER}")


def complete(gateway: str, model: str) -> httpx.Response:
    return httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0})


class Load:
    """CLIENTS threads sending PROMPT to one tier until stopped; every outcome is recorded, an
    exception as a failure."""

    def __init__(self, gateway: str, model: str) -> None:
        self.gateway, self.model = gateway, model
        self.records: list[dict] = []
        self.stop = threading.Event()
        self.pause_s = 0.0  # between one client's requests: 0 is back to back
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def _client(self) -> None:
        for _ in range(5000):  # bounded; stopped long before
            if self.stop.is_set():
                return
            rec: dict = {"start": time.monotonic()}
            try:
                resp = complete(self.gateway, self.model)
                rec.update(status=resp.status_code, tier=resp.headers.get("x-yieldgate-tier"),
                           requested=resp.headers.get("x-yieldgate-requested-tier"),
                           replica=resp.headers.get("x-yieldgate-replica"),
                           version=resp.headers.get("x-yieldgate-weight-version"),
                           request_id=resp.headers.get("x-request-id"),
                           service_tier=resp.json().get("service_tier") if resp.status_code == 200 else None,
                           text=resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text)
            except Exception as exc:  # noqa: BLE001 - a failed request, counted
                rec.update(status=None, error=f"{type(exc).__name__}: {exc}")
            rec["end"] = time.monotonic()
            with self.lock:
                self.records.append(rec)
            self.stop.wait(self.pause_s)

    def served_by(self, replica: str, after: float = 0.0) -> int:
        with self.lock:
            return sum(1 for r in self.records if r.get("replica") == replica and r["start"] > after)

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)


def wait_for(predicate, what: str, timeout_s: float, poll=None):
    deadline = time.monotonic() + timeout_s
    while not (value := predicate()):
        if poll is not None:
            poll()
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)
    return value


@pytest.mark.parametrize("victim,other", [("standard", "fast"), ("fast", "standard")])
def test_sigkill_of_an_engine_fails_over_restarts_it_and_restores_its_weights(
        stack, admin, pushed, adapter, victim, other):
    name = REPLICA[victim]
    fleet = admin.get("/admin/fleet").json()
    assert fleet[name]["engine"]["state"] == "running", fleet[name]   # supervised, up
    pid, restarts = fleet[name]["engine"]["pid"], fleet[name]["engine"]["restarts"]
    book = PriceBook(load_config(stack.config_path).pricing)
    usage = Usage(prompt_tokens=10, cached_tokens=0, completion_tokens=8)
    assert book.cost("demo", victim, usage).total != book.cost("demo", other, usage).total  # pricing can tell

    degraded_seen: list[dict] = []

    def watch_health() -> None:
        health = httpx.get(stack.gateway_url + "/healthz", timeout=10).json()
        if victim in health["degraded_tiers"]:
            degraded_seen.append(health)

    with Load(stack.gateway_url, MODEL[victim]) as load:
        wait_for(lambda: load.served_by(name) >= CLIENTS, "load on the victim", 120)
        os.kill(pid, signal.SIGKILL)  # the API server only, as an OOM kill would: its core is orphaned
        killed_at = time.monotonic()
        wait_for(lambda: load.served_by(REPLICA[other], after=killed_at) >= 5, "failover traffic", 120,
                 poll=watch_health)
        # Failover shown; the traffic goes on, paced, so the engine restarting on these 2 cores
        # is not starved by 4 clients keeping the other engine busy.
        load.pause_s = 0.5

        def back() -> bool:
            r = admin.get("/admin/fleet").json()[name]
            return (r["engine"]["restarts"] == restarts + 1 and r["engine"]["state"] == "running"
                    and r["healthy"] and r["admitted"] and not r["restoring"])

        wait_for(back, f"{name} restarted and admitted", RESTART_BUDGET_S, poll=watch_health)
        back_at = time.monotonic()
        wait_for(lambda: load.served_by(name, after=back_at) >= 3, "traffic back on the victim", 120)

    records = load.records
    failed = [r for r in records if r["status"] != 200]
    # Only requests in flight on the engine when it died may fail (unary: re-sent elsewhere, so
    # usually none do); every request sent after the kill is answered.
    assert all(r["start"] < killed_at for r in failed), failed
    assert len(failed) <= CLIENTS, failed

    # Served by the other tier meanwhile, and saying so (until the victim's first answer again:
    # the admin poll sees it back a moment after the router does).
    returned_at = min(r["start"] for r in records if r["start"] > killed_at and r.get("replica") == name)
    outage = [r for r in records if r["status"] == 200 and killed_at < r["start"] and r["end"] < returned_at]
    assert len(outage) >= 5
    assert {(r["tier"], r["requested"], r["replica"]) for r in outage} == {(other, victim, REPLICA[other])}
    assert {r["service_tier"] for r in outage} == {"priority" if other == "fast" else "default"}
    assert {(r["version"], r["text"]) for r in outage} == {(VERSION, pushed[other])}

    # Back on the weights the fleet serves, from the engine's own mouth and by its answers.
    after = [r for r in records if r["start"] > back_at and r.get("replica") == name]
    assert after and {(r["tier"], r["requested"], r["version"], r["text"]) for r in after} == \
        {(victim, None, VERSION, pushed[victim])}
    engine_version = httpx.get(stack.engines[victim] + "/weight_info", timeout=30).json()["weight_version"]
    assert engine_version == VERSION
    new_pid = admin.get("/admin/fleet").json()[name]["engine"]["pid"]
    assert new_pid != pid and not psutil.pid_exists(pid)
    orphans = [p.pid for p in psutil.process_iter(["status"]) if _pgid(p.pid) == pid
               and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert orphans == []  # the killed server's EngineCore went with it

    assert degraded_seen and all(h["status"] == "degraded" and h["tiers"][victim]["served_by"] == other
                                 for h in degraded_seen)

    # The ledger: requested and served tier, priced as the tier that served.
    ledger = {row["request_id"]: row for row in csv.DictReader(io.StringIO(admin.get("/admin/ledger.csv").text))}
    for r in outage[:5]:
        row = ledger[r["request_id"]]
        assert (row["tier"], row["requested_tier"]) == (other, victim)
        used = Usage(int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["completion_tokens"]))
        assert Decimal(row["cost_total"]) == book.cost("demo", other, used).total

    # Its LoRA adapter was loaded into the restarted engine again, and answers as before from it.
    def adapter_back() -> bool:
        doc = next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == ADAPTER)
        return doc["replicas"][name] == {"v1": "resident"}

    wait_for(adapter_back, f"{ADAPTER} resident on {name} again", 120)
    assert ADAPTER + "@v1" in {m["id"] for m in httpx.get(stack.engines[victim] + "/v1/models").json()["data"]}
    r = complete(stack.gateway_url, ADAPTER + MODEL[victim].removeprefix("demo"))
    assert (r.status_code, r.headers["x-yieldgate-replica"], r.headers["x-yieldgate-weight-version"],
            r.json()["choices"][0]["text"]) == (200, name, ADAPTER + "@v1", adapter[victim])

    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(
        httpx.get(stack.gateway_url + "/metrics", timeout=10).text) for s in f.samples}
    assert samples[("yieldgate_engine_restarts_total", (("reason", "exited"), ("replica", name)))] >= 1
    assert samples[("yieldgate_tier_failovers_total",
                    (("requested_tier", victim), ("served_tier", other)))] >= len(outage)


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None
