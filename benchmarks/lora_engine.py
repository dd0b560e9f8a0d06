"""What enabling LoRA costs a demo engine: start-up time and decode speed, side by side.

    flock /tmp/yg-heavy.lock python benchmarks/lora_engine.py [--port 26300] [--rounds 1]

Starts the demo fleet's standard-0 engine exactly as `yieldgate up` launches it (same command,
environment, core), alternately without and with the fleet's LoRA flags (`--enable-lora
--max-lora-rank 8 --max-loras 2`), `--rounds` times each. Per start: seconds from spawn to a 200
on /health, then output tokens per second of greedy 128-token completions (ignore_eos), one at a
time and 4 at once, for the base model and, with LoRA on, for a loaded random rank-8 adapter.
Writes benchmarks/results/lora_engine.json.
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

from stacks import decode_rate, demo_engine  # benchmarks/stacks.py

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"


def run_once(port: int, lora: bool, adapter: Path, home: Path) -> dict:
    t0 = time.perf_counter()
    with demo_engine(port, lora, home / f"engine-lora-{lora}.log") as url:
        row: dict = {"lora": lora, "startup_s": round(time.perf_counter() - t0, 1)}
        row["base_tok_s_c1"] = round(decode_rate(url, "demo", 1), 1)
        row["base_tok_s_c4"] = round(decode_rate(url, "demo", 4), 1)
        if lora:
            httpx.post(url + "/v1/load_lora_adapter", timeout=60,
                       json={"lora_name": "bench", "lora_path": str(adapter)}).raise_for_status()
            row["adapter_tok_s_c1"] = round(decode_rate(url, "bench", 1), 1)
            row["adapter_tok_s_c4"] = round(decode_rate(url, "bench", 4), 1)
        row["load_avg_1m"] = round(os.getloadavg()[0], 2)
        print(row, flush=True)
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--port", type=int, default=26300)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "lora_engine.json"))
    args = ap.parse_args()
    from yieldgate.serving.demo_model import ensure_demo_model
    from yieldgate.serving.peft import random_adapter

    with tempfile.TemporaryDirectory() as tmp:
        home = Path(tmp)
        os.environ["YIELDGATE_HOME"] = str(home)  # the engine's KV-event socket goes here
        adapter = random_adapter(ensure_demo_model(), home / "adapter", seed=1)
        rows = [run_once(args.port, lora, adapter, home) for _ in range(args.rounds) for lora in (False, True)]

    def mean(key: str, lora: bool) -> float:
        return statistics.mean(r[key] for r in rows if r["lora"] == lora and key in r)

    summary = {
        "startup_s": {"off": mean("startup_s", False), "on": mean("startup_s", True)},
        "startup_ratio_on_off": round(mean("startup_s", True) / mean("startup_s", False), 3),
        "base_decode_ratio_on_off_c1": round(mean("base_tok_s_c1", True) / mean("base_tok_s_c1", False), 3),
        "base_decode_ratio_on_off_c4": round(mean("base_tok_s_c4", True) / mean("base_tok_s_c4", False), 3),
        "adapter_vs_base_decode_c1": round(mean("adapter_tok_s_c1", True) / mean("base_tok_s_c1", True), 3),
        "adapter_vs_base_decode_c4": round(mean("adapter_tok_s_c4", True) / mean("base_tok_s_c4", True), 3),
    }
    Path(args.out).write_text(json.dumps({
        "meta": harness.meta(["serving/", "benchmarks/lora_engine.py"]),
        "engine": "demo standard-0 as launched by `yieldgate up` (prefix caching, KV events, core 0)",
        "summary": summary, "runs": rows}, indent=2))
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
