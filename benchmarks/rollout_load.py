"""The steady load of benchmarks/rollout.py, in a process of its own.

    python benchmarks/rollout_load.py --gateway URL --out FILE [--concurrency 4] [--chunk-s 10] [--model demo]

A loadtest `run_load` (closed loop, `--concurrency` workers, completions on `--model`, the base
model "demo" or an adapter's name) plus two version probes (`<model>`, `<model>:fast`: a 4-token
greedy completion every 50 ms each, recording the weight-version and replica headers). It runs
until its stdin closes (the parent's "stop"), then writes nothing more and exits. Every finished
request is one JSON line in `--out`: {"kind": "load", "end", "ok", "error"} or {"kind": "probe",
"t", "end", "model", "status", "version", "replica"[, "error"]} (unix seconds).

Why a separate process: in the benchmark's own process the load shared a GIL with the trainer's
push, so the timed push also measured how busy the load generator kept the interpreter.
`run_load` has no outside stop, so the load runs in `--chunk-s` slices back to back; between two
slices the closed loop is briefly below `--concurrency` while the last requests finish.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import IO

import httpx

from yieldgate.loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, RequestRecord, Target, run_load


class JsonLines:
    """Thread-safe, line-buffered JSON lines: the parent reads whatever was written."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.lock = threading.Lock()

    def write(self, record: dict) -> None:
        line = json.dumps(record) + "\n"
        with self.lock:
            self.out.write(line)
            self.out.flush()


def probe(gateway: str, model: str, stop: threading.Event, out: JsonLines) -> None:
    with httpx.Client(timeout=120) as http:
        while not stop.is_set():
            t0 = time.time()
            try:
                r = http.post(gateway + "/v1/completions", json={
                    "model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0})
                out.write({"kind": "probe", "t": t0, "end": time.time(), "model": model,
                           "status": r.status_code,
                           "version": r.headers.get("x-yieldgate-weight-version", ""),
                           "replica": r.headers.get("x-yieldgate-replica", "")})
            except httpx.HTTPError as exc:
                out.write({"kind": "probe", "t": t0, "end": time.time(), "model": model, "status": 0,
                           "version": "", "replica": "", "error": type(exc).__name__})
            time.sleep(0.05)


def steady_load(gateway: str, model: str, concurrency: int, chunk_s: float, stop: threading.Event,
                out: JsonLines) -> None:
    def record(rec: RequestRecord) -> None:
        out.write({"kind": "load", "end": time.time(), "ok": rec.ok, "error": rec.error})

    while not stop.is_set():
        run_load(Target(base_url=gateway, model=model, api="completions"),
                 RandomLengthWorkload(input_tokens=64, output_tokens=16), ConcurrencyLoad(concurrency=concurrency),
                 Bounds(requests=None, duration_s=chunk_s), on_record=record)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gateway", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--chunk-s", type=float, default=10.0)
    ap.add_argument("--model", default="demo", help="the base model or an adapter's name")
    args = ap.parse_args()
    gw = args.gateway.rstrip("/")
    stop = threading.Event()
    with open(args.out, "w") as f:
        out = JsonLines(f)
        workers = [threading.Thread(target=probe, args=(gw, m, stop, out), daemon=True)
                   for m in (args.model, args.model + ":fast")]
        workers.append(threading.Thread(target=steady_load, args=(gw, args.model, args.concurrency, args.chunk_s,
                                                                  stop, out), daemon=True))
        for w in workers:
            w.start()
        sys.stdin.read()  # until the parent closes our stdin (or exits)
        stop.set()
        for w in workers:
            w.join(args.chunk_s + 130)


if __name__ == "__main__":
    main()
