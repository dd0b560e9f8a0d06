"""Weight updates of the demo fleet under steady load, orchestrated by the gateway.

    python benchmarks/rollout.py --up                      # starts its own demo stack (ports 215xx)
    python benchmarks/rollout.py --up --big                # the same with a 28 MB generated model
    python benchmarks/rollout.py --gateway URL --admin-token TOKEN   # or uses a running one

A loadtest `run_load` (steady concurrency, both tiers) keeps the fleet busy while a trainer-side
`push(gateway=..., mode=...)` rolls perturbed copies of the demo weights through it, `--rollouts`
rounds of one push per `--modes` entry (rolling, all_at_once, rolling, ...: <version>.1, .2, ...,
interleaved so both modes see the same load); two probes record the version header of every
response they get. The load and the probes run in a process of their own
(benchmarks/rollout_load.py): sharing this one, they shared a GIL with the trainer's push.
Reported: failed requests (goal 0), responses with an unknown version or a replica going back to
an older one (goal 0), the timeline of each rollout, and push start -> 100% of traffic on the new
version (the later of the last re-admission and the end of the last old-version response).

Raw transfer time, as used for the goal (rollout < 2x): a direct `push()` of the same bytes
(same dtype, asked from the engines once) into every engine at once (arm, stream, verify, load,
commit the version, reset the prefix cache; no drain, no checkpoint, no verify), under the same
load in the same run: one just before and one just after each round of rollouts (the weights
every replica serves at that moment, re-pushed under the version they already serve, after one
untimed warm-up push), so none changes what any response says and slow drift of the machine's
load hits raw pushes and rollouts alike (`--no-interleave`: `--direct-pushes` before all rounds
and as many after them). The ratio is
median(time to 100% new) / median(raw transfer), per mode; both come with their interquartile
range (this machine's run-to-run noise is large: read the ratio with them). The fleet is rolled
back to the version it served before. `--runs` (default 3) whole measurements, each on a fresh
stack with --up, every one kept: benchmarks/results/rollout[-big].json (benchmarks/harness.py's
format; the table shows their median and range) and .png (the last run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

import harness  # benchmarks/harness.py, beside this script
from stacks import load_process, model_dir, own_stack, perturbed, read_records, spread, wait_for_traffic
from yieldgate.trainer_bridge import EngineClient, push

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def steps(timeline: list[dict], start: float) -> dict[str, float]:
    """Where one rollout's time went, from its timeline: push start -> the rollout starts, then
    per replica drain (out of routing -> drained, update begins), apply, verify, re-admit."""
    out: dict[str, float] = {}
    began = next((e["t"] for e in timeline if e["event"] == "start"), None)
    if began is not None:
        out["push_to_rollout_start"] = began - start
    for rep in sorted({e["replica"] for e in timeline if e["replica"]}):
        t = {}
        for e in timeline:  # the last of each event for this replica (an early drain is repeated)
            if e["replica"] == rep:
                t[e["event"]] = e["t"]
        for name, a, b in (("drain", "drain", "update"), ("apply", "update", "updated"),
                           ("verify", "updated", "verified"), ("readmit", "verified", "admitted")):
            if a in t and b in t:
                out[f"{rep}.{name}"] = t[b] - t[a]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", default="http://127.0.0.1:8000")
    ap.add_argument("--admin-token", default=None)
    ap.add_argument("--up", action="store_true", help="start a private demo stack for the run")
    ap.add_argument("--port", type=int, default=21500, help="gateway port with --up")
    ap.add_argument("--version", default="bench", help="rollouts push <version>.1, .2, ...")
    ap.add_argument("--rollouts", type=int, default=6, help="rounds: each pushes once per mode")
    ap.add_argument("--direct-pushes", type=int, default=None,
                    help="with --no-interleave: timed direct pushes before and as many after (default: --rollouts)")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=True,
                    help="one direct push before and one after each round (default), instead of "
                         "--direct-pushes before all rounds and as many after them")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--modes", default="rolling,all_at_once",
                    help="comma-separated; each rollout round pushes once per mode, interleaved")
    ap.add_argument("--big", action="store_true",
                    help="with --up: a 28 MB generated model (4 layers, 384 hidden) instead of the 1.1 MB demo")
    ap.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS,
                    help="whole measurements (each --rollouts rounds), every one kept in the result")
    ap.add_argument("--out", default=None, help="default benchmarks/results/rollout[-big]")
    args = ap.parse_args()
    args.out = args.out or str(RESULTS / ("rollout-big" if args.big else "rollout"))
    if args.direct_pushes is None:
        args.direct_pushes = args.rollouts
    if not args.up and not args.admin_token:
        ap.error("--admin-token is required without --up")
    out = Path(args.out)
    rec = harness.Recording(out.name, MEASURES, out=out.with_suffix(".json"))
    runs = []
    version = args.version
    for i in range(args.runs):
        args.version = f"{version}{i}"
        if args.up:
            with own_stack(args.port, model_dir(args.big)) as (gateway, token):
                runs.append(measure(args, gateway, token))
        else:
            runs.append(measure(args, args.gateway, args.admin_token))
    modes = list(runs[0]["modes"])
    rec.write(runs=runs, summary={
        **{f"{m}_to_raw_transfer": harness.summarize(r["modes"][m]["time_to_100pct_new_s"] / r["raw_transfer_seconds"]
                                                       for r in runs) for m in modes},
        "failed": sum(r["failed_load"] + r["failed_probe"] for r in runs),
        "requests": sum(r["requests_load"] for r in runs)})
    plot(runs[-1], out.with_suffix(".png"))


MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "trainer_bridge/", "loadtest/", "benchmarks/rollout.py",
            "benchmarks/rollout_load.py"]


def measure(args: argparse.Namespace, gateway: str, admin_token: str) -> dict:
    """One measurement: --rollouts rounds of every mode between direct pushes; its summary."""
    gw = gateway.rstrip("/")
    load_start = os.getloadavg()[0]
    admin = httpx.Client(base_url=gw, timeout=300, headers={"Authorization": f"Bearer {admin_token}"})
    before = {n: r["weight_version"] for n, r in admin.get("/admin/weights").json()["replicas"].items()}
    old = next(iter(set(before.values())))
    if old != "base":
        raise SystemExit(f"the fleet serves {old!r}; start from the launch weights (base)")
    base = load_file(str(model_dir(args.big) / "model.safetensors"))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    plan = [m for _ in range(args.rollouts) for m in modes]  # interleaved: rolling, all_at_once, ...
    versions = [f"{args.version}.{i}" for i in range(1, len(plan) + 1)]
    weights = {v: perturbed(base, 7 + i) for i, v in enumerate(versions)}
    direct = admin.get("/admin/weight_targets", params={"direct": 1}).json()
    # Every push sends the same bytes: the engines' serving dtype, asked once up front.
    dtype = EngineClient(direct["engines"][0]).model_dtype()
    if dtype is None:
        raise SystemExit("could not read the engines' serving dtype from /server_info")

    def direct_pushes(wset: dict, version: str, n: int) -> list:
        targets = admin.get("/admin/weight_targets", params={"direct": 1}).json()
        return [push(wset, version, engines=targets["engines"], token=targets["push_token"],
                     dtype=dtype, progress=False) for _ in range(n)]

    def served() -> tuple[dict, str]:
        """The weights every replica serves now and the engine's name for them: a direct push
        of exactly these changes no response."""
        now = {r["weight_version"] for r in admin.get("/admin/weights").json()["replicas"].values()}
        if len(now) != 1:
            raise SystemExit(f"replicas serve {sorted(now)}: no direct push can leave every response as it is")
        label = now.pop()
        return (base, "default") if label == old else (weights[label], label)

    records_path = Path(tempfile.mkdtemp(prefix="yg-rollout-load-")) / "records.jsonl"
    with load_process(gw, args.concurrency, records_path):
        wait_for_traffic(records_path)
        time.sleep(args.settle_s / 2)
        # Raw transfer, before: the weights the engines already serve, under the version they report,
        # straight into every engine at once -- changes no response. The first update after engine
        # start pays one-time set-up (staging memory): pushed once untimed.
        push(base, "default", engines=direct["engines"], token=direct["push_token"], dtype=dtype, progress=False)
        raw_before = [] if args.interleave else direct_pushes(base, "default", args.direct_pushes)
        time.sleep(args.settle_s / 2)
        rollouts = []
        raw_after = []
        previous = old
        for i, (version, mode) in enumerate(zip(versions, plan)):
            if args.interleave and i % len(modes) == 0:
                # Each round: direct pushes of what is served just before and just after its
                # rollouts, so slow drift of this machine's load hits raw and rollout alike.
                if i:
                    raw_after += direct_pushes(*served(), 1)
                    time.sleep(args.settle_s / 2)
                raw_before += direct_pushes(*served(), 1)
                time.sleep(args.settle_s / 2)
            push_start = time.time()
            report = push(weights[version], version, gateway=gw, token=admin_token, dtype=dtype,
                          progress=False, mode=mode)
            push_end = time.time()
            print(f"[rollout] {version} ({mode}): push returned after {push_end - push_start:.2f} s", flush=True)
            time.sleep(args.settle_s)
            state = admin.get("/admin/weights").json()["rollout"]
            rollouts.append({"version_from": previous, "version_to": version, "push_start": push_start,
                             "push_end": push_end, "report": report, "state": state, "mode": mode,
                             "load_avg_1m": os.getloadavg()[0]})
            previous = version
        # Raw transfer, after: the last weights under the last version (already served everywhere).
        raw_after += direct_pushes(*served(), 1 if args.interleave else args.direct_pushes)
        time.sleep(1.0)
        load_end = os.getloadavg()[0]

    records, probes = read_records(records_path)
    failed_load = [r for r in records if not r["ok"]]
    failed_probe = [p for p in probes if p["status"] != 200]
    mixed = [p for p in probes if p["status"] == 200 and p["version"] not in (old, *versions)]
    # A clean switch per replica: once it answered with version k, it never answers an older one.
    order = {v: i for i, v in enumerate([old, *versions])}
    regressions = 0
    for replica in {p["replica"] for p in probes if p["status"] == 200}:
        served = [order[p["version"]] for p in sorted(probes, key=lambda p: p["end"])
                  if p["replica"] == replica and p["status"] == 200 and p["version"] in order]
        regressions += sum(b < a for a, b in zip(served, served[1:]))
    raw_all = [r.seconds for r in raw_before + raw_after]
    raw_spread = spread(raw_all)
    raw = raw_spread["median"]
    t0 = rollouts[0]["push_start"]
    per_rollout = []
    for ro in rollouts:
        start, state = ro["push_start"], ro["state"]
        # 100% on new: the last re-admission, or the end of the last old-version response if later.
        admitted = [e["t"] for e in state["timeline"] if e["event"] == "admitted"]
        old_after = [p["end"] for p in probes if p["version"] == ro["version_from"] and p["t"] >= start]
        all_new_at = max([*admitted, *old_after], default=start)
        first_new = min((p["end"] for p in probes if p["version"] == ro["version_to"]), default=None)
        per_rollout.append({
            "mode": ro["mode"], "version_from": ro["version_from"], "version_to": ro["version_to"],
            "state": state["state"], "reason": state["reason"],
            "push_start_s": start - t0,
            "push_seconds": ro["push_end"] - start,
            "time_to_100pct_new_s": all_new_at - start,
            "first_new_response_s": (first_new - start) if first_new else None,
            "trainer_stream_seconds": ro["report"].transfer_seconds,
            "trainer_stream_targets": ro["report"].engines,
            "bytes_per_engine": ro["report"].bytes_per_engine,
            "steps_s": steps(state["timeline"], start),
            "timeline_from_push_start_s": [[round(e["t"] - start, 3), e["event"], e["replica"], e["detail"]]
                                           for e in state["timeline"]],
        })
    to_new = statistics.median(r["time_to_100pct_new_s"] for r in per_rollout if r["mode"] == modes[0])
    by_mode = {}
    for mode in modes:
        runs = [r for r in per_rollout if r["mode"] == mode]
        to_new_spread = spread([r["time_to_100pct_new_s"] for r in runs])
        med = to_new_spread["median"]
        # Longest time any probe request took that started during the rollout (the hold shows here).
        worst = max((p["end"] - p["t"] for r in runs for p in probes
                     if p["status"] == 200 and r["push_start_s"] <= p["t"] - t0 <= r["push_start_s"] + r["time_to_100pct_new_s"]),
                    default=None)
        names = sorted({k for r in runs for k in r["steps_s"]})
        by_mode[mode] = {"time_to_100pct_new_s": med, "time_to_100pct_new": to_new_spread,
                         "steps_median_s": {k: statistics.median(r["steps_s"][k] for r in runs if k in r["steps_s"])
                                            for k in names},
                         "time_to_100pct_new_all_s": [r["time_to_100pct_new_s"] for r in runs],
                         "ratio_to_raw_transfer": med / raw,
                         # The ratio's spread: quartiles of one over the other quartiles of the other.
                         "ratio_q1_over_q3_to_q3_over_q1": [to_new_spread["q1"] / raw_spread["q3"],
                                                            to_new_spread["q3"] / raw_spread["q1"]],
                         "longest_probe_request_s": worst}
    summary = {
        "modes": by_mode,
        "version_from": old, "versions": versions,
        "rollout_states": [r["state"] for r in per_rollout],
        "requests_load": len(records), "failed_load": len(failed_load),
        "failed_load_errors": sorted({str(r["error"]) for r in failed_load}),
        "requests_probe": len(probes), "failed_probe": len(failed_probe),
        "probe_responses_with_unknown_version": len(mixed),
        "probe_version_regressions": regressions,
        "time_to_100pct_new_s": to_new,
        "time_to_100pct_new_all_s": [r["time_to_100pct_new_s"] for r in per_rollout],
        "raw_transfer_seconds": raw,
        "raw_transfer": raw_spread,
        "raw_transfer_definition": ("median of direct push() calls of the same bytes (same dtype) into every "
                                    "engine at once (arm, stream, verify, load, commit version, reset "
                                    "prefix cache), under the same load, "
                                    + ("one just before and one just after each round of rollouts (after one "
                                       "untimed warm-up push)" if args.interleave else
                                       "before (after one untimed warm-up push) and after the rollouts")),
        "direct_pushes_interleaved": args.interleave,
        "direct_push_before_seconds": [r.seconds for r in raw_before],
        "direct_push_after_seconds": [r.seconds for r in raw_after],
        "direct_stream_seconds": [r.transfer_seconds for r in raw_before + raw_after],
        "ratio_to_raw_transfer": to_new / raw,
        "ratio_definition": ("median time_to_100pct_new over the rollouts of one mode / median raw transfer "
                             "(top-level figures: the first mode; per mode under 'modes'); medians and "
                             "interquartile ranges under 'raw_transfer' and modes.*.time_to_100pct_new"),
        "goal": "time_to_100pct_new_s < 2 x raw_transfer_seconds, 0 failed, no mixed versions",
        "dtype": str(dtype),
        "bytes_per_engine": per_rollout[0]["bytes_per_engine"],
        "concurrency": args.concurrency,
        "cpus": os.cpu_count(),
        "load_avg_1m_start": load_start,
        "load_avg_1m_end": load_end,
        "load_avg_1m_after_each_rollout": [ro["load_avg_1m"] for ro in rollouts],
        "load_generator": ("benchmarks/rollout_load.py in its own process (closed loop in back-to-back "
                           "10 s slices + two probes), not sharing the trainer's GIL"),
        "rollouts": per_rollout,
        "probes": [{k: v for k, v in p.items() if k != "kind"} | {"t": p["t"] - t0, "end": p["end"] - t0}
                   for p in probes],
    }
    rb = admin.post("/admin/weights/rollback", json={"to_version": old})
    summary["rollback_status"] = rb.status_code
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rollouts", "probes")}, indent=2))
    for r in per_rollout:
        print(r["version_to"], r["mode"], f"{r['time_to_100pct_new_s']:.3f}s")
        for e in r["timeline_from_push_start_s"]:
            print("   ", e)
    return summary


def plot(summary: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(12, 3.8))
    replicas = sorted({p["replica"] for p in summary["probes"] if p["replica"]})
    versions = [summary["version_from"], *summary["versions"]]
    palette = plt.get_cmap("tab20").colors
    colors = {v: palette[i % len(palette)] for i, v in enumerate(versions)}
    for i, rep in enumerate(replicas):
        for ver in versions:
            pts = [p["end"] for p in summary["probes"] if p["replica"] == rep and p["version"] == ver]
            ax.scatter(pts, [i] * len(pts), s=12, color=colors.get(ver, "grey"), label=ver if i == 0 else None)
    fails = [p["end"] for p in summary["probes"] if p["status"] != 200]
    ax.scatter(fails, [-0.5] * len(fails), marker="x", color="red", label="failed")
    for ro in summary["rollouts"]:
        t = ro["push_start_s"]
        ax.axvline(t, color="black", lw=0.8)
        for at, event, _, _ in ro["timeline_from_push_start_s"]:
            if event in ("drain", "admitted"):
                ax.axvline(t + at, color="grey", lw=0.6, ls=":" if event == "drain" else "-")
        ax.axvline(t + ro["time_to_100pct_new_s"], color="green", lw=1.2)
    ax.set_yticks(range(len(replicas)), replicas)
    ax.set_xlabel("seconds since the first push (black: push start, dotted: drain, grey: re-admit, green: 100% new)")
    def quartiles(d: dict) -> str:
        return f"{d['median']:.2f} s (IQR {d['q1']:.2f}-{d['q3']:.2f}, n={d['n']})"

    per_mode = "; ".join(f"{m}: {quartiles(v['time_to_100pct_new'])} = {v['ratio_to_raw_transfer']:.1f}x raw"
                         for m, v in summary["modes"].items())
    ax.set_title(f"{len(summary['rollouts'])} weight updates under load "
                 f"({summary['bytes_per_engine'] / 1e6:.1f} MB per engine): "
                 f"{summary['failed_load'] + summary['failed_probe']} failed requests; 100% new after\n"
                 f"{per_mode}; raw transfer {quartiles(summary['raw_transfer'])}", fontsize=8)
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.02), fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
