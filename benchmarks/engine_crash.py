"""An engine crash under load, once per tier: what clients see and how long the fleet is short.

    python benchmarks/engine_crash.py                  # starts its own demo stack (ports 216xx)

`yieldgate up` serves the demo fleet (one standard, one fast engine) on a checkpoint version, so a
restarted engine must get its weights back. Four clients per tier send short greedy completions
throughout, unary and streamed (`--streams` of the clients stream). For each tier in turn, its
engine's API server is SIGKILLed (as an OOM kill would; its EngineCore is orphaned and the
supervisor must kill it too). Reported per crash: requests sent while it was out, how many failed
(streams cut with an error event counted apart), how many the other tier served (and whether they
were labelled so), the gateway's own re-sends to another replica (yieldgate_upstream_retries_total:
failures it avoided, counted, never merged into the request), time from the kill to the engine
answering health again (supervisor restart + vLLM start-up) and to its re-admission (plus the
gateway's weight restore). `--runs` (default 3) times on a fresh stack, every run kept:
benchmarks/results/engine_crash.json (benchmarks/harness.py's format) and .png (the last run).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

import harness  # benchmarks/harness.py, beside this script
from stacks import own_stack  # benchmarks/stacks.py: `yieldgate up` on private ports
from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.trainer_bridge import write_checkpoint

RESULTS = Path(__file__).parent / "results"
MODEL = {"standard": "demo", "fast": "demo:fast"}
REPLICA = {"standard": "standard-0", "fast": "fast-0"}
VERSION = "crash-bench-1"


class Clients:
    """`n` threads per tier sending completions until stopped; every outcome recorded."""

    def __init__(self, gateway: str, n: int, streams: int = 0) -> None:
        self.gateway = gateway
        self.records: list[dict] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(tier, i < streams), daemon=True)
                        for tier in MODEL for i in range(n)]

    def _run(self, tier: str, stream: bool) -> None:
        with httpx.Client(timeout=120) as client:
            for i in range(100_000):  # bounded; stopped long before
                if self.stop.is_set():
                    return
                rec = {"tier": tier, "start": time.time(), "stream": stream}
                body = {"model": MODEL[tier], "prompt": f"Request {i % 50}: once upon a time",
                        "max_tokens": 8, "temperature": 0, "stream": stream}
                try:
                    with client.stream("POST", self.gateway + "/v1/completions", json=body) as resp:
                        text = resp.read()
                    rec.update(status=resp.status_code, served=resp.headers.get("x-yieldgate-tier"),
                               requested=resp.headers.get("x-yieldgate-requested-tier"),
                               version=resp.headers.get("x-yieldgate-weight-version"))
                    if stream and resp.status_code == 200 and b"data: [DONE]" not in text:
                        rec["cut"] = True  # the stream ended with an error event instead of its end
                        rec["status"] = "cut"
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
    failed = [r for r in sent + in_flight if r["status"] != 200 and not r.get("cut")]
    cut = [r for r in sent + in_flight if r.get("cut")]
    by_other = [r for r in sent if r["status"] == 200 and r["served"] == other]
    return {**event, "requests_while_out": len(sent), "in_flight_at_kill": len(in_flight),
            "failed": len(failed), "streams_cut": len(cut), "served_by_other_tier": len(by_other),
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


def gateway_retries(gateway: str) -> float:
    """The gateway's re-sends to another replica so far (every tier)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(gateway + "/metrics", timeout=10).text
    return sum(s.value for f in text_string_to_metric_families(text) if f.name == "yieldgate_upstream_retries"
               for s in f.samples if s.name == "yieldgate_upstream_retries_total")


def crash_run(args: argparse.Namespace, model_dir: Path) -> tuple[dict, list[dict], list[dict], float]:
    """One stack, load on both tiers, each tier's engine killed in turn; (run, records, events, t0)."""
    with own_stack(args.port, model_dir) as (gateway, token), \
            httpx.Client(base_url=gateway, timeout=300, headers={"Authorization": f"Bearer {token}"}) as admin:
        base = load_file(str(model_dir / "model.safetensors"))
        g = torch.Generator().manual_seed(11)
        ckpt = write_checkpoint({k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()},
                                model_dir, Path(tempfile.mkdtemp(prefix="yg-crash-")) / VERSION)
        state = admin.post("/admin/weights", json={"version": VERSION, "source": {"checkpoint": str(ckpt)},
                                                   "wait": True}).json()["rollout"]
        assert state["state"] == "succeeded", state
        retries_before = gateway_retries(gateway)
        clients = Clients(gateway, args.clients, args.streams)
        t0 = time.time()
        clients.start()
        events = []
        for tier in MODEL:
            time.sleep(args.settle_s)
            events.append(crash(admin, tier))
        time.sleep(args.settle_s)
        records = clients.finish()
        resent = gateway_retries(gateway) - retries_before
    run = {"requests": len(records), "streams": sum(r["stream"] for r in records),
           "failed": sum(r["status"] != 200 and not r.get("cut") for r in records),
           "streams_cut": sum(bool(r.get("cut")) for r in records),
           "gateway_resent": int(resent), "crashes": [summarize(records, e) for e in events]}
    return run, records, events, t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=21600)
    ap.add_argument("--clients", type=int, default=4, help="concurrent clients per tier")
    ap.add_argument("--streams", type=int, default=2, help="of which this many stream")
    ap.add_argument("--settle-s", type=float, default=20, help="load before and between the crashes")
    ap.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS)
    ap.add_argument("--out", type=Path, default=RESULTS / "engine_crash.json")
    args = ap.parse_args()
    model_dir = ensure_demo_model()
    rec = harness.Recording("engine_crash", MEASURES, out=args.out)
    runs = []
    for i in range(args.runs):
        run, records, events, t0 = crash_run(args, model_dir)
        runs.append({"round": i, **run})
        print(json.dumps(run, indent=1))
    plot(records, events, t0, args.out.with_suffix(".png"))
    rec.write(runs=runs, summary={
        k: harness.summarize(r[k] for r in runs) for k in ("requests", "failed", "streams_cut", "gateway_resent")}
        | {f"admitted_s_{tier}": harness.summarize(c["admitted_s"] for r in runs for c in r["crashes"] if c["tier"] == tier)
           for tier in MODEL},
        setup=f"{args.clients} clients per tier ({args.streams} streaming), greedy completions of 8 tokens")


MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "trainer_bridge/", "benchmarks/engine_crash.py"]


if __name__ == "__main__":
    main()
