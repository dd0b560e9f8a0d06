"""Rolling weight update of the demo fleet under steady load, orchestrated by the gateway.

    python benchmarks/rollout.py --up                      # starts its own demo stack (ports 215xx)
    python benchmarks/rollout.py --gateway URL --admin-token TOKEN   # or uses a running one

A loadtest `run_load` (steady concurrency, both tiers) keeps the fleet busy while a trainer-side
`push(gateway=...)` rolls a perturbed copy of the demo weights through it; probe threads record
the version header of every response they get. Reported: failed requests (goal 0), the timeline
of versions served, and push start -> 100% of traffic on the new version (the later of the last
re-admission and the end of the last old-version response) against the raw transfer time.

Raw transfer time, as used for the goal (rollout < 2x): a direct `push()` of the same number of
bytes into every engine at once (arm, stream, verify, load, commit the version, reset the
prefix cache; no drain, no checkpoint, no verify), under the same load in the same run. It is
measured twice, before the rollout (the old weights, re-pushed under the version they already
serve) and after it (the new weights under the new version), so neither push changes what any
response says; the mean is the denominator. The fleet is rolled back to the version it served
before. Writes benchmarks/results/rollout.json and rollout.png.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

from gateway.embedded import stop_process_group
from loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, Target, run_load
from serving.demo_model import ensure_demo_model
from trainer_bridge import push

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def own_stack(port: int):
    """`yieldgate up` on a private home and ports (gateway `port`, engines port+101, +102)."""
    home = Path(tempfile.mkdtemp(prefix="yg-rollout-"))
    token = "bench-admin-" + secrets.token_hex(8)
    config = home / "yieldgate.toml"
    config.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
admin_token = "{token}"
redis_url = "redis://127.0.0.1:6379/{os.environ.get('YIELDGATE_TEST_REDIS_DB', '15')}"

[fleet]
model = "demo"
block_size = 32
demo_base_port = {port + 101}
""")
    env = dict(os.environ, YIELDGATE_HOME=str(home), PYTHONUNBUFFERED="1",
               YIELDGATE_FLEET__MODEL_PATH=str(ensure_demo_model()))
    log = open(home / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "up", "--config", str(config)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"yieldgate up exited:\n{(home / 'up.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("stack not healthy after 900 s")
            time.sleep(2)
        yield url, token
    finally:
        stop_process_group(proc)
        log.close()


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
    ap.add_argument("--admin-token", default=None)
    ap.add_argument("--up", action="store_true", help="start a private demo stack for the run")
    ap.add_argument("--port", type=int, default=21500, help="gateway port with --up")
    ap.add_argument("--version", default="bench-1")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--out", default=str(RESULTS / "rollout"))
    args = ap.parse_args()
    if args.up:
        with own_stack(args.port) as (gateway, token):
            measure(args, gateway, token)
    else:
        if not args.admin_token:
            ap.error("--admin-token is required without --up")
        measure(args, args.gateway, args.admin_token)


def measure(args: argparse.Namespace, gateway: str, admin_token: str) -> None:
    gw = gateway.rstrip("/")
    load_start = os.getloadavg()[0]
    admin = httpx.Client(base_url=gw, timeout=300, headers={"Authorization": f"Bearer {admin_token}"})
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
    time.sleep(args.settle_s / 2)
    # Raw transfer, before: the weights the engines already serve, under the version they report,
    # straight into every engine at once -- changes no response.
    if old != "base":
        raise SystemExit(f"the fleet serves {old!r}; start from the launch weights (base)")
    direct = admin.get("/admin/weight_targets", params={"direct": 1}).json()
    for _ in range(2):  # the first update after engine start pays one-time set-up; time the second
        baseline_before = push(base, "default", engines=direct["engines"], token=direct["push_token"],
                               progress=False)
    time.sleep(args.settle_s / 2)
    push_start = time.time()
    report = push(weights, args.version, gateway=gw, token=admin_token, progress=False)
    push_end = time.time()
    time.sleep(args.settle_s)
    # Raw transfer, after: the new weights under the new version (already served everywhere).
    direct = admin.get("/admin/weight_targets", params={"direct": 1}).json()
    baseline = push(weights, args.version, engines=direct["engines"], token=direct["push_token"],
                    progress=False)
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join(60)
    loader.join(120)
    state = admin.get("/admin/weights").json()["rollout"]

    # 100% on new: the last re-admission, or the end of the last old-version response if later.
    admitted = [e["t"] for e in state["timeline"] if e["event"] == "admitted"]
    old_after = [p["end"] for p in probes if p["version"] == old and p["t"] >= push_start]
    all_new_at = max([*admitted, *old_after], default=push_start)
    first_new = min((p["end"] for p in probes if p["version"] == args.version), default=None)
    records = load_result["result"].records if "result" in load_result else []
    failed_load = [r for r in records if not r.ok]
    failed_probe = [p for p in probes if p["status"] != 200]
    mixed = [p for p in probes if p["status"] == 200 and p["version"] not in (old, args.version)]
    raw = (baseline_before.seconds + baseline.seconds) / 2
    to_new = all_new_at - push_start
    events = {e["event"]: e["t"] - push_start for e in state["timeline"]}
    summary = {
        "version_from": old, "version_to": args.version,
        "rollout_state": state["state"], "rollout_reason": state["reason"],
        "requests_load": len(records), "failed_load": len(failed_load),
        "failed_load_errors": sorted({str(r.error) for r in failed_load}),
        "requests_probe": len(probes), "failed_probe": len(failed_probe),
        "probe_responses_with_unknown_version": len(mixed),
        "push_seconds": push_end - push_start,
        "time_to_100pct_new_s": to_new,
        "first_new_response_s": (first_new - push_start) if first_new else None,
        "raw_transfer_seconds": raw,
        "raw_transfer_definition": ("mean of two direct push() calls of the same bytes into every "
                                    "engine at once (arm, stream, verify, load, commit version, reset "
                                    "prefix cache), under the same load, before (after one warm-up "
                                    "push) and after the rollout"),
        "direct_push_before_seconds": baseline_before.seconds,
        "direct_push_after_seconds": baseline.seconds,
        "direct_stream_seconds": [baseline_before.transfer_seconds, baseline.transfer_seconds],
        "ratio_to_raw_transfer": to_new / raw,
        "goal": "time_to_100pct_new_s < 2 x raw_transfer_seconds, 0 failed, no mixed versions",
        "trainer_stream_seconds": report.transfer_seconds,
        "trainer_stream_targets": report.engines,
        "staged_at_s": events.get("staged"),
        "bytes_per_engine": report.bytes_per_engine,
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": os.getloadavg()[0],
        "timeline_from_push_start_s": [[round(e["t"] - push_start, 3), e["event"], e["replica"], e["detail"]]
                                       for e in state["timeline"]],
        "timeline": state["timeline"],
        "probes": [{**p, "t": p["t"] - push_start, "end": p["end"] - push_start} for p in probes],
    }
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
                 f"(raw transfer {summary['raw_transfer_seconds']:.2f}s)", fontsize=9)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
