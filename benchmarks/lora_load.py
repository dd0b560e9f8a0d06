"""How long loading a LoRA adapter takes on a demo engine: the simulator's `lora_load_s`.

    flock /tmp/yg-heavy.lock python benchmarks/lora_load.py [--port 26310] [--adapters 8] [--rounds 3]

Starts the demo fleet's standard-0 engine exactly as `yieldgate up` launches it, LoRA on (the
fleet's `--enable-lora --max-lora-rank 8 --max-loras 2`), and for each of `--adapters` seeded random
rank-8 adapters, `--rounds` times: POST /v1/load_lora_adapter (timed), one 1-token completion for
it (its first request: the adapter enters a slot), a second one (warm), POST
/v1/unload_lora_adapter (timed). A 1-token base-model completion before each load is the
reference. Writes benchmarks/results/lora_load.json.
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

import harness  # benchmarks/harness.py, beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def timed_post(url: str, path: str, body: dict) -> float:
    t = time.perf_counter()
    httpx.post(url + path, json=body, timeout=120).raise_for_status()
    return time.perf_counter() - t


def one_token(url: str, model: str) -> float:
    return timed_post(url, "/v1/completions", {"model": model, "prompt": "once upon a time", "max_tokens": 1,
                                               "temperature": 0})


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def measure(url: str, adapters: list[Path], rounds: int) -> list[dict]:
    one_token(url, "demo")  # warm-up
    rows = []
    for k in range(rounds):
        for i, path in enumerate(adapters):
            name = f"bench-{i}"
            row = {"round": k, "adapter": name, "base_request_s": one_token(url, "demo"),
                   "load_s": timed_post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})}
            row["first_request_s"] = one_token(url, name)
            row["warm_request_s"] = one_token(url, name)
            row["unload_s"] = timed_post(url, "/v1/unload_lora_adapter", {"lora_name": name})
            rows.append({key: round(v, 4) if isinstance(v, float) else v for key, v in row.items()})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=26310)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "lora_load.json"))
    args = ap.parse_args()
    from stacks import demo_engine  # benchmarks/stacks.py
    from yieldgate.serving.demo_model import ensure_demo_model
    from yieldgate.serving.peft import random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        os.environ["YIELDGATE_HOME"] = str(home)  # the engine's KV-event socket goes here
        model = ensure_demo_model()
        adapters = [random_adapter(model, home / f"adapter-{i}", seed=i + 1) for i in range(args.adapters)]
        with demo_engine(args.port, True, home / "engine.log") as url:
            rows = measure(url, adapters, args.rounds)

    def col(key: str) -> list[float]:
        return [r[key] for r in rows]

    summary = {key: {"p50": round(statistics.median(col(key)), 4), "p90": round(pct(col(key), 90), 4)}
               for key in ("load_s", "unload_s", "first_request_s", "warm_request_s", "base_request_s")}
    summary["first_minus_warm_request_s_p50"] = round(statistics.median(
        [r["first_request_s"] - r["warm_request_s"] for r in rows]), 4)
    Path(args.out).write_text(json.dumps({
        "meta": harness.meta(["serving/", "benchmarks/lora_load.py"]),
        "engine": "demo standard-0 as launched by `yieldgate up`, LoRA on (max_loras 2, max rank 8); "
                  "adapters: serving.peft.random_adapter rank 8 on the attention projections",
        "summary": summary, "runs": rows}, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
