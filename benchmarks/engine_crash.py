"""An engine crash under load, once per tier: what clients see and how long the fleet is short.

    python benchmarks/engine_crash.py                  # starts its own demo stack (ports 216xx)

`yieldgate up` serves the demo fleet (one standard, one fast engine) on a checkpoint version, so a
restarted engine must get its weights back. Four clients per tier send short greedy completions
throughout. For each tier in turn, its engine's API server is SIGKILLed (as an OOM kill would;
its EngineCore is orphaned and the supervisor must kill it too). Reported per crash: requests
sent while it was out, how many failed, how many the other tier served (and whether they were
labelled so), time from the kill to the engine answering health again (supervisor restart +
vLLM start-up) and to its re-admission (plus the gateway's weight restore). Writes
benchmarks/results/engine_crash.json and .png (completions per second by serving tier).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from rollout import own_stack  # benchmarks/rollout.py: `yieldgate up` on private ports
from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.trainer_bridge import write_checkpoint

RESULTS = Path(__file__).parent / "results"
MODEL = {"standard": "demo", "fast": "demo:fast"}
REPLICA = {"standard": "standard-0", "fast": "fast-0"}
VERSION = "crash-bench-1"


class Clients:
    """`n` threads per tier sending completions until stopped; every outcome recorded."""

    def __init__(self, gateway: str, n: int) -> None:
        self.gateway = gateway
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(tier,), daemon=True)
                        for tier in MODEL for _ in range(n)]

    def _run(self, tier: str) -> None:
        with httpx.Client(timeout=120) as client:
            for i in range(100_000):  # bounded; stopped long before
                if self.stop.is_set():
                    return
                rec = {"tier": tier, "start": time.time()}
                try:
                    resp = client.post(self.gateway + "/v1/completions", json={
                        "model": MODEL[tier], "prompt": f"Request {i % 50}: once upon a time",
                        "max_tokens": 8, "temperature": 0})
                    rec.update(status=resp.status_code, served=resp.headers.get("x-yieldgate-tier"),
                               requested=resp.headers.get("x-yieldgate-requested-tier"),
                               version=resp.headers.get("x-yieldgate-weight-version"))
                except httpx.HTTPError as exc:
                    rec.update(status=None, error=type(exc).__name__)
                rec["end"] = time.time()
                with self.lock:
                    self.records.append(rec)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> list[dict]:
        self.stop.set()
        for t in self.threads:
            t.join(150)
        return self.records


def crash(admin: httpx.Client, tier: str, budget_s: float = 900) -> dict:
    name = REPLICA[tier]
    before = admin.get("/admin/fleet").json()[name]
    pid, restarts = before["engine"]["pid"], before["engine"]["restarts"]
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    healthy_at = admitted_at = None
    deadline = time.monotonic() + budget_s
    while admitted_at is None and time.monotonic() < deadline:
        r = admin.get("/admin/fleet").json()[name]
        if r["engine"]["restarts"] > restarts and r["engine"]["state"] == "running" and healthy_at is None:
            healthy_at = time.time()
        if healthy_at and r["healthy"] and r["admitted"] and not r["restoring"]:
            admitted_at = time.time()
            version = r["weight_version"]
        time.sleep(0.25)
    if admitted_at is None:
        raise RuntimeError(f"{name} not back within {budget_s:.0f} s")
    print(f"[crash] {name}: engine healthy {healthy_at - killed:.1f} s, admitted {admitted_at - killed:.1f} s "
          f"after the kill, serving {version}", file=sys.stderr)
    return {"tier": tier, "replica": name, "killed_at": killed, "engine_healthy_s": round(healthy_at - killed, 2),
            "admitted_s": round(admitted_at - killed, 2), "restored_version": version}


def summarize(records: list[dict], event: dict) -> dict:
    tier, other = event["tier"], "fast" if event["tier"] == "standard" else "standard"
    lo, hi = event["killed_at"], event["killed_at"] + event["admitted_s"]
    sent = [r for r in records if r["tier"] == tier and lo <= r["start"] < hi]
    in_flight = [r for r in records if r["tier"] == tier and r["start"] < lo < r["end"]]
    failed = [r for r in sent + in_flight if r["status"] != 200]
    by_other = [r for r in sent if r["status"] == 200 and r["served"] == other]
    return {**event, "requests_while_out": len(sent), "in_flight_at_kill": len(in_flight),
            "failed": len(failed), "served_by_other_tier": len(by_other),
            "labelled_with_requested_tier": sum(r["requested"] == tier for r in by_other),
            "other_tier_requests_failed": sum(1 for r in records if r["tier"] == other and lo <= r["start"] < hi
                                              and r["status"] != 200)}


def plot(records: list[dict], events: list[dict], t0: float, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    end = max(r["end"] for r in records)
    seconds = int(end - t0) + 1
    fig, ax = plt.subplots(figsize=(10, 4))
    for served, color in (("standard", "tab:blue"), ("fast", "tab:orange")):
        for requested, style in (("standard", "-"), ("fast", "--")):
            counts = [0] * seconds
            for r in records:
                if r["status"] == 200 and r["served"] == served and r["tier"] == requested:
                    counts[int(r["end"] - t0)] += 1
            ax.plot(range(seconds), counts, style, color=color, label=f"asked {requested}, served by {served}")
    failed = [int(r["end"] - t0) for r in records if r["status"] != 200]
    if failed:
        ax.scatter(failed, [0] * len(failed), marker="x", color="red", label="failed", zorder=3)
    for e in events:
        k = e["killed_at"] - t0
        ax.axvline(k, color="red", lw=0.8)
        ax.axvspan(k, k + e["admitted_s"], color="grey", alpha=0.15)
        ax.text(k, ax.get_ylim()[1] * 0.92, f" kill {e['replica']}\n back {e['admitted_s']:.0f} s", fontsize=8)
    ax.set_xlabel("seconds")
    ax.set_ylabel("completions per second")
    ax.set_title("Engine SIGKILL under load: the other tier serves until the engine is back")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=21600)
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients per tier")
    ap.add_argument("--settle-s", type=float, default=20, help="load before and between the crashes")
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_crash.json")
    args = ap.parse_args()
    model_dir = ensure_demo_model()
    load_start = os.getloadavg()[0]
    with own_stack(args.port, model_dir) as (gateway, token), \
            httpx.Client(base_url=gateway, timeout=300, headers={"Authorization": f"Bearer {token}"}) as admin:
        base = load_file(str(model_dir / "model.safetensors"))
        g = torch.Generator().manual_seed(11)
        ckpt = write_checkpoint({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()},
                                model_dir, Path(tempfile.mkdtemp(prefix="yg-crash-")) / VERSION)
        state = admin.post("/admin/weights", json={"version": VERSION, "source": {"checkpoint": str(ckpt)},
                                                   "wait": True}).json()["rollout"]
        assert state["state"] == "succeeded", state
        clients = Clients(gateway, args.clients)
        t0 = time.time()
        clients.start()
        events = []
        for tier in MODEL:
            time.sleep(args.settle_s)
            events.append(crash(admin, tier))
        time.sleep(args.settle_s)
        records = clients.finish()
    crashes = [summarize(records, e) for e in events]
    result = {
        "meta": {"commit": subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                          cwd=Path(__file__).parent).stdout.strip(),
                 "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
                 "machine": {"cores": os.cpu_count(), "gpu": None,
                             "load_avg_1m": {"start": load_start, "end": os.getloadavg()[0]}},
                 "load": f"{args.clients} clients per tier, greedy completions of 8 tokens",
                 "command": "python benchmarks/engine_crash.py"},
        "requests": len(records), "failed": sum(r["status"] != 200 for r in records),
        "crashes": crashes,
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(records, events, t0, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in result.items() if k != "meta"}, indent=1))


if __name__ == "__main__":
    main()
