"""An adapter push vs a full-weight push of the same base model, each under steady load.

    flock /tmp/yg-heavy.lock python benchmarks/adapter_push.py [--port 21700] [--rounds 5]

Starts the demo stack (benchmarks/rollout.py's `own_stack`: `yieldgate up` on loopback, both
engines with LoRA on) and runs `--rounds` rounds of, in turn:
  * adapter: a steady load whose requests name the adapter (benchmarks/rollout_load.py in its
    own process, `--concurrency` clients and two version probes, `<adapter>` and
    `<adapter>:fast`), while a trainer's `push_adapter` sends version N+1 of a seeded random
    rank-8 LoRA of the demo model;
  * full, per `--modes` entry: the same load on the base model's name, while a trainer's `push`
    streams a perturbed copy of the whole base model through the gateway in that mode.
Each push has a load process of its own, started before and stopped after it. Per push:
seconds from the push call's start to the first response naming the new version and to 100% on
it (the latest of the push call's return, which the gateway answers once every replica serves
the new version, the end of the last response naming the old one and the first response naming
the new one); bytes the trainer sent; failed requests (load and probes); responses naming a
version they could not have come from (a version other than the old and the new one, the old one
on a request sent after the push returned, or the old one on a replica after a response naming
the new one had ended there).
An untimed adapter version v0 and an untimed direct push of the launch weights come first (each
path's one-time set-up: the first LoRA load, the engines' staging memory).
Writes benchmarks/results/adapter_push.json (medians and interquartile ranges per kind, every
round with its probe responses) and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import tempfile
import time
from pathlib import Path

import httpx
from safetensors.torch import load_file

import harness  # benchmarks/harness.py, beside this script
from stacks import load_process, model_dir, own_stack, perturbed, read_records, spread, wait_for_traffic
from yieldgate.serving.peft import random_adapter
from yieldgate.trainer_bridge import EngineClient, push, push_adapter

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
ADAPTER = "bench-lora"


def switch(probes: list[dict], load: list[dict], start: float, end: float, old: str, new: str) -> dict:
    """One push's figures from the responses of its load process: `start`/`end` bracket the
    push call, `old`/`new` are the version labels before and after it."""
    ok = sorted((p for p in probes if p["status"] == 200), key=lambda p: p["t"])
    first_new = min((p["end"] for p in ok if p["version"] == new), default=None)
    last_old = max((p["end"] for p in ok if p["version"] == old), default=start)
    unknown = [p for p in ok if p["version"] not in (old, new)]
    stale = [p for p in ok if p["version"] == old and p["t"] > end]
    # Once a replica answered with the new version, a request it starts later cannot get the old one.
    regressions = [p for p in ok if p["version"] == old and any(
        q["replica"] == p["replica"] and q["version"] == new and q["end"] < p["t"] for q in ok)]
    return {
        "first_new_response_s": first_new - start if first_new is not None else None,
        # 100% is seen by clients: every request sent now goes to the new version, no response
        # naming the old one is still to come, and one naming the new one has arrived.
        "time_to_100pct_new_s": max(end, last_old, first_new or end) - start,
        "push_seconds": end - start,
        "requests_load": len(load), "failed_load": sum(not r["ok"] for r in load),
        "failed_load_errors": sorted({str(r["error"]) for r in load if not r["ok"]}),
        "requests_probe": len(probes), "failed_probe": sum(p["status"] != 200 for p in probes),
        "responses_with_impossible_version": len(unknown) + len({id(p) for p in stale + regressions}),
        "impossible": {"unknown_version": len(unknown), "old_after_push_returned": len(stale),
                       "old_after_new_on_replica": len(regressions)},
        "probes": [[round(p["t"] - start, 3), round(p["end"] - start, 3), p["status"],
                    {old: "old", new: "new"}.get(p["version"], p["version"]), p["replica"]] for p in probes],
    }


def served_version(admin: httpx.Client) -> str:
    """The one weight version every replica serves (the label base-model responses carry)."""
    now = {r["weight_version"] for r in admin.get("/admin/weights").json()["replicas"].values()}
    if len(now) != 1:
        raise SystemExit(f"replicas serve {sorted(now)}; a full push starts from one version")
    return now.pop()


def adapter_current(admin: httpx.Client) -> dict:
    return next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == ADAPTER)


def wait_slot_free(admin: httpx.Client, version: str, timeout_s: float = 60.0) -> None:
    """Until no replica holds `version` of the adapter: an engine keeps `max_loras` (2)
    adapters, and a push loads the new version next to the current one."""
    deadline = time.monotonic() + timeout_s
    while any(version in held for held in adapter_current(admin)["replicas"].values()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{ADAPTER}@{version} still loaded after {timeout_s:.0f} s")
        time.sleep(0.2)


def measure(args: argparse.Namespace, gw: str, token: str) -> dict:
    admin = httpx.Client(base_url=gw, timeout=300, headers={"Authorization": f"Bearer {token}"})
    # The adapter registry lives in the shared Redis, so it outlives the stack: start and end clean.
    admin.delete(f"/admin/adapters/{ADAPTER}")
    try:
        return push_rounds(args, gw, token, admin)
    finally:
        admin.delete(f"/admin/adapters/{ADAPTER}")


def push_rounds(args: argparse.Namespace, gw: str, token: str, admin: httpx.Client) -> dict:
    model = model_dir(False)
    # Adapter versions of this run only (engines name a loaded adapter by name and version).
    tag = secrets.token_hex(2)
    adapter_version = {i: f"{tag}.v{i}" for i in range(-1, args.rounds + 1)}
    scratch = Path(tempfile.mkdtemp(prefix="yg-adapter-push-"))
    adapters = {i: load_file(str(random_adapter(model, scratch / f"v{i}", seed=100 + i) / "adapter_model.safetensors"))
                for i in range(args.rounds + 1)}
    base = load_file(str(model / "model.safetensors"))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    full_versions = [f"bench.{i}" for i in range(1, args.rounds * len(modes) + 1)]
    weights = {v: perturbed(base, 7 + i) for i, v in enumerate(full_versions)}

    # Untimed set-up of each path: the adapter's first version, and the engines' staging memory
    # (a direct push of the launch weights under the engines' own name for them: no label changes).
    push_adapter(adapters[0], name=ADAPTER, version=adapter_version[0], gateway=gw, token=token)
    direct = admin.get("/admin/weight_targets", params={"direct": 1}).json()
    dtype = EngineClient(direct["engines"][0]).model_dtype()
    if dtype is None:
        raise SystemExit("could not read the engines' serving dtype from /server_info")
    push(base, "default", engines=direct["engines"], token=direct["push_token"], dtype=dtype, progress=False)

    rounds = []
    for r in range(1, args.rounds + 1):
        for kind in ["adapter", *[f"full_{m}" for m in modes]]:
            records = scratch / f"{r}-{kind}.jsonl"
            if kind == "adapter":
                old_version = adapter_current(admin)["current"]
                wait_slot_free(admin, adapter_version[r - 2])
                old, new, model_name = f"{ADAPTER}@{old_version}", f"{ADAPTER}@{adapter_version[r]}", ADAPTER
            else:
                version = full_versions[len([x for x in rounds if x["kind"] != "adapter"])]
                old, new, model_name = served_version(admin), version, "demo"
            with load_process(gw, args.concurrency, records, model=model_name, chunk_s=args.chunk_s):
                wait_for_traffic(records)
                time.sleep(args.settle_s / 2)
                start = time.time()
                if kind == "adapter":
                    report = push_adapter(adapters[r], name=ADAPTER, version=adapter_version[r], gateway=gw,
                                          token=token)
                    sent = {"bytes_sent": report.bytes, "bytes_note": "one upload to the gateway; the engines "
                            "load the adapter from the gateway's home"}
                else:
                    report = push(weights[new], new, gateway=gw, token=token, dtype=dtype, progress=False,
                                  mode=kind.removeprefix("full_"))
                    sent = {"bytes_sent": report.bytes_per_engine * len(report.engines),
                            "bytes_per_engine": report.bytes_per_engine, "stream_targets": len(report.engines),
                            "bytes_note": "one stream per target: the gateway's copy and each engine"}
                end = time.time()
                time.sleep(args.settle_s)
            load, probes = read_records(records)
            row = {"round": r, "kind": kind, "version_from": old, "version_to": new, **sent,
                   **switch(probes, load, start, end, old, new), "load_avg_1m": os.getloadavg()[0]}
            rounds.append(row)
            print(f"[adapter_push] round {r} {kind}: {old} -> {new}: 100% new after "
                  f"{row['time_to_100pct_new_s']:.2f} s, first new {row['first_new_response_s']}, "
                  f"{row['failed_load'] + row['failed_probe']} failed, "
                  f"{row['responses_with_impossible_version']} impossible", flush=True)
    return {"rounds": rounds, "dtype": str(dtype)}


def summarize(rounds: list[dict]) -> dict:
    kinds = {}
    for kind in dict.fromkeys(r["kind"] for r in rounds):
        runs = [r for r in rounds if r["kind"] == kind]
        kinds[kind] = {
            "time_to_100pct_new": spread([r["time_to_100pct_new_s"] for r in runs]),
            "first_new_response": spread([r["first_new_response_s"] for r in runs
                                          if r["first_new_response_s"] is not None]),
            "push_seconds": spread([r["push_seconds"] for r in runs]),
            "bytes_sent": statistics.median(r["bytes_sent"] for r in runs),
            "requests": sum(r["requests_load"] + r["requests_probe"] for r in runs),
            "failed": sum(r["failed_load"] + r["failed_probe"] for r in runs),
            "responses_with_impossible_version": sum(r["responses_with_impossible_version"] for r in runs),
        }
    return kinds


def plot(doc: dict, path: Path) -> None:
    """Left: per kind, the medians (bars) and rounds (dots) of the two times. Right: every probe
    response around each push, old version grey, new green, failed red; black: the push returned."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = doc["kinds"]
    fig, (bars, timeline) = plt.subplots(1, 2, figsize=(13, 4.2), gridspec_kw={"width_ratios": [1, 1.4]})
    for i, kind in enumerate(kinds):
        runs = [r for r in doc["rounds"] if r["kind"] == kind]
        for offset, key, color in ((-0.18, "first_new_response_s", "tab:blue"),
                                   (0.18, "time_to_100pct_new_s", "tab:green")):
            values = [r[key] for r in runs if r[key] is not None]
            bars.bar(i + offset, statistics.median(values), width=0.34, color=color, alpha=0.5,
                     label=("first response on new" if key.startswith("first") else "100% on new") if i == 0 else None)
            bars.scatter([i + offset] * len(values), values, color=color, s=14, zorder=3)
    labels = [f"{k.replace('_', ' ')}\n{v['bytes_sent'] / 1e6:.2f} MB sent\n{v['failed']} failed of {v['requests']}"
              for k, v in kinds.items()]
    bars.set_xticks(range(len(kinds)), labels, fontsize=8)
    bars.set_ylabel("seconds from the push call's start")
    bars.set_title(f"medians (bars) of {doc['rounds_per_kind']} rounds (dots), load conc. {doc['concurrency']}",
                   fontsize=8)
    bars.legend(fontsize=8)
    ordered = sorted(doc["rounds"], key=lambda r: (list(kinds).index(r["kind"]), r["round"]))
    colors = {"old": "grey", "new": "tab:green"}
    window = max(r["time_to_100pct_new_s"] for r in ordered) + 1.0
    for y, r in enumerate(ordered):
        for _, end, status, version, _ in r["probes"]:
            if -1.0 <= end <= window:
                timeline.scatter(end, y, s=9, color=colors.get(version, "red") if status == 200 else "red")
        timeline.plot([r["push_seconds"]] * 2, [y - 0.4, y + 0.4], color="black", lw=1)
    timeline.axvline(0, color="black", lw=0.6, ls=":")
    timeline.set_yticks(range(len(ordered)), [f"{r['kind'].replace('_', ' ')} #{r['round']}" for r in ordered],
                        fontsize=7)
    timeline.set_xlabel("probe response end, seconds from the push call's start (grey old, green new)")
    fig.suptitle("Adapter push vs full-weight push of the demo model under load", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=21700, help="gateway port; engines port+101, +102")
    ap.add_argument("--rounds", type=int, default=5, help="rounds: each pushes the adapter, then full weights per mode")
    ap.add_argument("--modes", default="rolling,all_at_once", help="full-weight push modes, comma-separated")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--settle-s", type=float, default=4.0)
    ap.add_argument("--chunk-s", type=float, default=4.0, help="the load process's slice (its stop waits for one)")
    ap.add_argument("--out", default=str(RESULTS / "adapter_push"))
    args = ap.parse_args()
    load_start = os.getloadavg()[0]
    with own_stack(args.port, model_dir(False)) as (gateway, token):
        measured = measure(args, gateway, token)
    rounds = measured["rounds"]
    doc = {
        "meta": harness.meta(["gateway/", "cache/", "serving/", "pricing/", "trainer_bridge/", "loadtest/", "benchmarks/adapter_push.py",
                              "benchmarks/stacks.py"], load_before=load_start),
        "adapter": f"{ADAPTER}: seeded random rank-8 LoRA of the demo model's attention (serving.peft.random_adapter)",
        "full_weights": "perturbed copies of the demo model, pushed through the gateway (trainer_bridge.push)",
        "dtype": measured["dtype"],
        "concurrency": args.concurrency,
        "rounds_per_kind": args.rounds,
        "definition": ("time_to_100pct_new_s: push call start -> the latest of its return (the gateway answers "
                       "once every replica serves the new version), the end of the last probe response "
                       "naming the old version and the end of the first naming the new one; "
                       "first_new_response_s: -> the end of the first probe response naming the new version; "
                       "failed: load and probe requests of the push's load process"),
        "probe_columns": ["sent_s", "end_s", "status", "version (old, new or as named)", "replica"],
        "kinds": summarize(rounds),
        "requests": sum(r["requests_load"] + r["requests_probe"] for r in rounds),
        "failed": sum(r["failed_load"] + r["failed_probe"] for r in rounds),
        "responses_with_impossible_version": sum(r["responses_with_impossible_version"] for r in rounds),
        "rounds": rounds,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in doc.items() if k != "rounds"}, indent=1))


if __name__ == "__main__":
    main()
