"""Tokens/s of the gateway's tiktoken path vs HF `tokenizers` on the same texts.

    python benchmarks/tokenizer_speed.py [--model-dir DIR] [--repeat 5]

Both produce identical ids (checked here too); single-threaded, one text per call,
as the gateway tokenizes one request at a time. The two paths alternate, `--repeat` passes each,
every pass kept; the figures are medians over the passes (benchmarks/harness.py's format).
Each tiktoken pass uses a fresh tokenizer, so it times encoding, not lookups in the segment cache
of an earlier pass. Writes benchmarks/results/tokenizer_speed.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script
from yieldgate.cache import Tokenizer

ROOT = Path(__file__).resolve().parents[1]


def texts(n: int = 400, seed: int = 7) -> list[str]:
    corpus = (ROOT / "serving" / "data" / "corpus.txt").read_text()
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = rng.choice([200, 1000, 4000])
        start = rng.randrange(0, max(1, len(corpus) - length))
        out.append(corpus[start:start + length])
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tokenizer_speed.json"))
    args = ap.parse_args()
    rec = harness.Recording("tokenizer_speed", ["cache/", "benchmarks/tokenizer_speed.py"], out=Path(args.out))
    if args.model_dir is None:
        from yieldgate.serving.demo_model import ensure_demo_model
        args.model_dir = str(ensure_demo_model())
    fast = Tokenizer.from_model_dir(args.model_dir)
    assert fast.backend == "tiktoken", fast.not_convertible_reason
    hf = fast.hf
    items = texts()
    assert all(fast.encode(t) == hf.encode(t).ids for t in items), "paths disagree"
    hf_encode = lambda t: hf.encode(t).ids  # noqa: E731

    def one_pass(encode) -> dict:
        t0 = time.perf_counter()
        n_tokens = sum(len(encode(t)) for t in items)
        seconds = time.perf_counter() - t0
        return {"tokens": n_tokens, "seconds": seconds, "tokens_per_s": n_tokens / seconds}

    # A fresh tokenizer per tiktoken pass: its segment cache starts empty, as for texts not seen before.
    runs = harness.repeat({"tiktoken": lambda: one_pass(Tokenizer.from_model_dir(args.model_dir).encode),
                           "hf_tokenizers": lambda: one_pass(hf_encode)}, n=args.repeat)
    speed = harness.by_target(runs, "tokens_per_s")
    rounds = sorted({r["round"] for r in runs})
    ratio = harness.summarize(
        next(r["tokens_per_s"] for r in runs if r["round"] == i and r["target"] == "tiktoken")
        / next(r["tokens_per_s"] for r in runs if r["round"] == i and r["target"] == "hf_tokenizers") for i in rounds)
    rec.write(runs=runs, summary={"tokens_per_s": speed, "speedup": ratio},
              setup=f"{len(items)} texts ({sum(map(len, items)):,} chars) of serving/data/corpus.txt, one per call",
              model_dir=args.model_dir)
    print(json.dumps({"tokens_per_s": speed, "speedup": ratio}, indent=2))


if __name__ == "__main__":
    main()
