"""Tokens/s of the gateway's tiktoken path vs HF `tokenizers` on the same texts.

    python benchmarks/tokenizer_speed.py [--model-dir DIR] [--repeat 5]

Both produce identical ids (checked here too); single-threaded, one text per call,
as the gateway tokenizes one request at a time. Writes benchmarks/results/tokenizer_speed.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

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


def bench(encode, items: list[str], repeat: int) -> tuple[float, int]:
    best = float("inf")
    n_tokens = 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        n_tokens = sum(len(encode(t)) for t in items)
        best = min(best, time.perf_counter() - t0)
    return best, n_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tokenizer_speed.json"))
    args = ap.parse_args()
    if args.model_dir is None:
        from yieldgate.serving.demo_model import ensure_demo_model
        args.model_dir = str(ensure_demo_model())
    fast = Tokenizer.from_model_dir(args.model_dir)
    assert fast.backend == "tiktoken", fast.not_convertible_reason
    hf = fast.hf
    items = texts()
    assert all(fast.encode(t) == hf.encode(t).ids for t in items), "paths disagree"
    hf_encode = lambda t: hf.encode(t).ids  # noqa: E731
    t_fast, n = bench(fast.encode, items, args.repeat)
    t_hf, n_hf = bench(hf_encode, items, args.repeat)
    assert n == n_hf
    result = {
        "model_dir": args.model_dir,
        "texts": len(items),
        "chars": sum(map(len, items)),
        "tokens": n,
        "tiktoken_tokens_per_s": round(n / t_fast),
        "hf_tokenizers_tokens_per_s": round(n / t_hf),
        "speedup": round(t_hf / t_fast, 2),
        "tiktoken_us_per_text": round(t_fast / len(items) * 1e6, 1),
        "hf_us_per_text": round(t_hf / len(items) * 1e6, 1),
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
