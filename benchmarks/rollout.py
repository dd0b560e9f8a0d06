"""Rolling weight update of the demo fleet under steady load, orchestrated by the gateway.

    python benchmarks/rollout.py --gateway http://127.0.0.1:8000 --admin-token TOKEN

A loadtest `run_load` (steady concurrency, both tiers) keeps the fleet busy while a trainer-side
`push(gateway=...)` rolls a perturbed copy of the demo weights through it; probe threads record
the version header of every response they get. Reported: failed requests (goal 0), the timeline
of versions served, push start -> 100% of traffic on the new version, against the raw transfer
time (trainer -> gateway stream + verify) and against a direct parallel push of the same weights
to every engine under the same load (goal: rollout < 2x). The fleet is rolled back to
the version it served before. Writes benchmarks/results/rollout.json and rollout.png.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, Target, run_load
from serving.demo_model import ensure_demo_model
from trainer_bridge import push

RESULTS = Path(__file__).parent / "results"


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


def probe(gateway: str, model: str, stop: threading.Event, out: list[dict]) -> None:
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            t0 = time.time()
            try:
                r = http.post(gateway + "/v1/completions", json={
                    "model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
                out.append({"t": t0, "end": time.time(), "model": model, "status": r.status_code,
                            "version": r.headers.get("x-yieldgate-weight-version", ""),
                            "replica": r.headers.get("x-yieldgate-replica", "")})
            except httpx.HTTPError as exc:
                out.append({"t": t0, "end": time.time(), "model": model, "status": 0,
                            "version": "", "replica": "", "error": type(exc).__name__})
            time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--admin-token", required=True)
    ap.add_argument("--version", default="bench-1")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--out", default=str(RESULTS / "rollout"))
    args = ap.parse_args()
    gw = args.gateway.rstrip("/")
    admin = httpx.Client(base_url=gw, timeout=300, headers={"Authorization": f"Bearer {args.admin_token}"})
    before = {n: r["weight_version"] for n, r in admin.get("/admin/weights").json()["replicas"].items()}
    old = next(iter(set(before.values())))
    base = load_file(str(Path(ensure_demo_model()) / "model.safetensors"))
    weights = perturbed(base, 7)

    stop = threading.Event()
    probes: list[dict] = []
    load_result: dict = {}

    def steady() -> None:
        res = run_load(Target(base_url=gw, model="demo", api="completions"),
                       RandomLengthWorkload(input_tokens=64, output_tokens=16), ConcurrencyLoad(concurrency=args.concurrency),
                       Bounds(requests=None, duration_s=args.settle_s * 2 + 30))
        load_result["result"] = res

    loader = threading.Thread(target=steady, daemon=True)
    threads = [threading.Thread(target=probe, args=(gw, m, stop, probes), daemon=True)
               for m in ("demo", "demo:fast")]
    loader.start()
    for t in threads:
        t.start()
    time.sleep(args.settle_s)
    push_start = time.time()
    report = push(weights, args.version, gateway=gw, token=args.admin_token, progress=False)
    push_end = time.time()
    time.sleep(args.settle_s)
    # Baseline under the same load: the same weights pushed straight to every engine at once (no
    # drain, no checkpoint, no verify) -- what moving the bytes costs by itself. The engines
    # already hold exactly these weights under this version, so no response is mislabelled.
    direct = admin.get("/admin/weight_targets", params={"direct": 1}).json()
    baseline = push(weights, args.version, engines=direct["engines"], token=direct["push_token"],
                    progress=False)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(60)
    loader.join(120)
    state = admin.get("/admin/weights").json()["rollout"]

    # 100% on new: the end of the last probe response that still carried the old version.
    old_after = [p["end"] for p in probes if p["version"] == old and p["t"] >= push_start]
    all_new_at = max(old_after, default=push_start)
    first_new = min((p["end"] for p in probes if p["version"] == args.version), default=None)
    records = load_result["result"].records if "result" in load_result else []
    failed_load = [r for r in records if not r.ok]
    failed_probe = [p for p in probes if p["status"] != 200]
    summary = {
        "version_from": old, "version_to": args.version,
        "rollout_state": state["state"], "rollout_reason": state["reason"],
        "requests_load": len(records), "failed_load": len(failed_load),
        "failed_load_errors": sorted({str(r.error) for r in failed_load}),
        "requests_probe": len(probes), "failed_probe": len(failed_probe),
        "push_seconds": push_end - push_start,
        "raw_transfer_seconds": report.transfer_seconds,
        "time_to_100pct_new_s": all_new_at - push_start,
        "first_new_response_s": (first_new - push_start) if first_new else None,
        "ratio_to_raw_transfer": (all_new_at - push_start) / report.transfer_seconds,
        "bytes_per_engine": report.bytes_per_engine,
        "timeline": state["timeline"],
        "probes": [{**p, "t": p["t"] - push_start, "end": p["end"] - push_start} for p in probes],
    }
    summary["direct_push_seconds"] = baseline.seconds
    summary["direct_transfer_seconds"] = baseline.transfer_seconds
    summary["ratio_to_direct_push"] = summary["time_to_100pct_new_s"] / baseline.seconds
    rb = admin.post("/admin/weights/rollback", json={"to_version": old})
    summary["rollback_status"] = rb.status_code
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=2))
    plot(summary, out.with_suffix(".png"), push_start)
    print(json.dumps({k: v for k, v in summary.items() if k not in ("timeline", "probes")}, indent=2))


def plot(summary: dict, path: Path, push_start: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 3.8))
    replicas = sorted({p["replica"] for p in summary["probes"] if p["replica"]})
    colors = {summary["version_from"]: "tab:blue", summary["version_to"]: "tab:orange"}
    for i, rep in enumerate(replicas):
        for ver, color in colors.items():
            pts = [p["end"] for p in summary["probes"] if p["replica"] == rep and p["version"] == ver]
            ax.scatter(pts, [i] * len(pts), s=12, color=color, label=f"{ver}" if i == 0 else None)
    fails = [p["end"] for p in summary["probes"] if p["status"] != 200]
    ax.scatter(fails, [-0.5] * len(fails), marker="x", color="red", label="failed")
    for ev in summary["timeline"]:
        if ev["event"] in ("drain", "admitted"):
            ax.axvline(ev["t"] - push_start, color="grey", lw=0.6, ls=":" if ev["event"] == "drain" else "-")
    ax.axvline(summary["time_to_100pct_new_s"], color="green", lw=1.2, label="100% new")
    ax.set_yticks(range(len(replicas)), replicas)
    ax.set_xlabel("seconds since push start (dotted: drain, solid: re-admit)")
    ax.set_title(f"rolling update {summary['version_from']} -> {summary['version_to']}: "
                 f"{summary['failed_load'] + summary['failed_probe']} failed requests, "
                 f"100% new at {summary['time_to_100pct_new_s']:.2f}s "
                 f"(direct push {summary['direct_push_seconds']:.2f}s)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
