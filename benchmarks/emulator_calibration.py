"""Calibrate the emulated engine's latency model against one real demo engine.

    python benchmarks/emulator_calibration.py [--model tiny|smollm2] [--port 26900]

Starts the demo fleet's standard-0 engine (as `yieldgate up` launches it, prefix caching on) on the
generated tiny Llama or on SmolLM2-135M, and measures, with prompts given as token ids so their lengths are exact:

- prefill: unique prompts of 128 to 1,536 tokens with max_tokens 1 -> latency = a + prefill × N;
- cached prefill: each of those prompts again (its blocks cached) -> context cost per cached token;
- decode: b streams at once (b = 1, 4, 16), 64 tokens each, ignore_eos -> inter-token time
  = step + per-sequence × b.

Fits `cache.simulator.EngineModel` (Theil-Sen lines) and writes
benchmarks/results/emulator-calibration-MODEL.json: every measurement, the fit, and the commit.
The emulator's engine models (serving/emulator.py, `CALIBRATED`) are these fits; a test checks they agree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness  # noqa: E402
from stacks import demo_engine  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
PREFILL_LENGTHS = (128, 256, 512, 1024, 1536)
DECODE_BATCHES = (1, 4, 16)
DECODE_TOKENS = 64
REPEATS = 3


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + b x -> (a, b) by Theil-Sen: b the median of the slopes between pairs of points, a the
    median of y - b x. On a shared machine one request now and then takes several times as long;
    least squares follows such a point, the medians do not."""
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(zip(xs, ys))
              for x2, y2 in zip(xs[i + 1:], ys[i + 1:]) if x2 != x1]
    b = statistics.median(slopes)
    return statistics.median(y - b * x for x, y in zip(xs, ys)), b


async def one(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    """One streamed completion: time to first token, end, cached tokens."""
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = None
    usage: dict = {}
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("choices") and first is None:
                first = time.perf_counter() - t0
            if event.get("usage"):
                usage = event["usage"]
    end = time.perf_counter() - t0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft_s": first, "e2e_s": end, "prompt_tokens": usage.get("prompt_tokens"),
            "completion_tokens": usage.get("completion_tokens"), "cached_tokens": cached}


async def measure(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731 (no cache hits by chance)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        await one(client, prompt(64), 4)  # warm-up
        prefill, cached = [], []
        for rep in range(REPEATS):
            for n in PREFILL_LENGTHS:
                p = prompt(n)
                prefill.append({"round": rep, "tokens": n, **await one(client, p, 1)})
                cached.append({"round": rep, "tokens": n, **await one(client, p, 1)})
        decode = []
        for rep in range(REPEATS):
            for b in DECODE_BATCHES:
                rows = await asyncio.gather(*(one(client, prompt(32), DECODE_TOKENS) for _ in range(b)))
                for r in rows:
                    r["itl_s"] = (r["e2e_s"] - r["ttft_s"]) / (DECODE_TOKENS - 1)
                decode.append({"round": rep, "batch": b, "itl_s": statistics.median(r["itl_s"] for r in rows),
                               "requests": rows})
    return {"prefill": prefill, "cached": cached, "decode": decode}


def fit(m: dict) -> dict:
    a, per_token = fit_line([r["tokens"] for r in m["prefill"]], [r["ttft_s"] for r in m["prefill"]])
    # A cached prompt still computes its tail (vLLM recomputes at least the last token) and reads the
    # cached context: latency - a - prefill x uncached = context x cached.
    ctx = [(r["ttft_s"] - a - per_token * (r["tokens"] - r["cached_tokens"])) / r["cached_tokens"]
           for r in m["cached"] if r["cached_tokens"]]
    step, per_seq = fit_line([r["batch"] for r in m["decode"]], [r["itl_s"] for r in m["decode"]])
    return {"prefill_s_per_token": per_token, "context_s_per_token": max(0.0, statistics.median(ctx)) if ctx else 0.0,
            "step_s": step, "decode_s_per_seq": max(0.0, per_seq), "prefill_intercept_s": a,
            "prefill_tokens_per_s": 1 / per_token,
            "decode_tokens_per_s_by_batch": {str(b): b / statistics.median(r["itl_s"] for r in m["decode"]
                                                                           if r["batch"] == b)
                                             for b in DECODE_BATCHES}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=26900)
    ap.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    ap.add_argument("--out", default="")
    ap.add_argument("--refit", action="store_true",
                    help="fit the measurements already in the result file again (same meta), measure nothing")
    args = ap.parse_args(argv)
    out = args.out or str(RESULTS / f"emulator-calibration-{args.model}.json")
    if args.refit:
        doc = json.loads(Path(out).read_text())
        doc["fit"] = fit(doc["measurements"])
        doc["meta"].setdefault("notes", {})["refit"] = "fit recomputed from these measurements by --refit"
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
        print(json.dumps(doc["fit"], indent=1))
        return
    load_before = os.getloadavg()[0]
    if args.model == "smollm2":
        from yieldgate.serving.smollm2 import ensure_smollm2

        model_dir = ensure_smollm2()
    else:
        from yieldgate.serving.demo_model import ensure_demo_model

        model_dir = ensure_demo_model()
    home = Path(tempfile.mkdtemp(prefix="yg-calib-"))
    os.environ["YIELDGATE_HOME"] = str(home)  # the engine's KV-event socket and logs go here
    with demo_engine(args.port, lora=False, log_path=home / "engine.log", model_dir=model_dir) as url:
        m = asyncio.run(measure(url, seed=0))
    f = fit(m)
    print(json.dumps(f, indent=1))
    doc = {"meta": harness.meta(["serving/demo_model.py", "serving/smollm2.py", "serving/launcher.py",
                                 "benchmarks/emulator_calibration.py"],
                                setup=f"one demo engine ({args.model}, standard-0 flags), prompts as token ids; "
                                      f"prefill {PREFILL_LENGTHS} tokens, decode batches {DECODE_BATCHES} x "
                                      f"{DECODE_TOKENS} tokens, {REPEATS} rounds",
                                load_before=load_before),
           "fit": f, "measurements": m}
    Path(out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
