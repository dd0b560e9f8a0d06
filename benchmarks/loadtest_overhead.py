"""How many small non-streaming requests/s the load generator pushes from one process, and its CPU
cost per request, against a trivial aiohttp upstream running in a separate process.

    python benchmarks/loadtest_overhead.py [--requests 20000] [--concurrency 64]

Writes benchmarks/results/loadtest_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script
from yieldgate.loadtest import Bounds, ConcurrencyLoad, PoissonLoad, RandomLengthWorkload, Target, run_load

RESULTS = Path(__file__).parent / "results"

SERVER = r'''
import sys, uvloop
from aiohttp import web
BODY = (b'{"id":"x","object":"chat.completion","model":"demo","choices":[{"index":0,"message":'
        b'{"role":"assistant","content":"ok"},"finish_reason":"stop"}],"usage":{"prompt_tokens":8,'
        b'"completion_tokens":1,"total_tokens":9,"prompt_tokens_details":{"cached_tokens":0}}}')
async def chat(request):
    await request.read()
    return web.Response(body=BODY, content_type="application/json")
async def models(request):
    return web.json_response({"data": [{"id": "demo"}]})
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
app.router.add_get("/v1/models", models)
uvloop.install()
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--concurrency", type=int, default=64)
    args = ap.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(100):
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=1)
                break
            except OSError:
                time.sleep(0.1)
        target = Target(base_url=url, model="demo", stream=False)
        wl = RandomLengthWorkload(input_tokens=8, output_tokens=1)
        run_load(target, wl, ConcurrencyLoad(concurrency=args.concurrency), Bounds(requests=2000))  # warm
        t0, cpu0 = time.perf_counter(), time.process_time()
        r = run_load(target, wl, ConcurrencyLoad(concurrency=args.concurrency), Bounds(requests=args.requests))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        # Open loop: does it keep a 1,500 req/s Poisson schedule (send lag = actual - planned send time)?
        po = run_load(target, wl, PoissonLoad(rate=1500.0), Bounds(requests=7500)).summary
    finally:
        server.terminate()
        server.wait(10)
    s = r.summary
    out = {
        "requests": s.completed,
        "failed": s.failed,
        "concurrency": args.concurrency,
        "request_throughput_rps": round(s.request_throughput, 1),
        "client_cpu_us_per_request": round(s.client_cpu_us_per_request or 0, 1),
        "client_cpu_us_per_request_incl_setup": round(cpu / max(1, s.completed) * 1e6, 1),
        # What one fully available core of client could push at this CPU cost per request.
        "client_capacity_rps_per_core": round(1e6 / (s.client_cpu_us_per_request or 1), 0),
        "e2e_ms_p50": round(s.e2e_ms.p(50), 3),
        "e2e_ms_p99": round(s.e2e_ms.p(99), 3),
        "wall_s": round(wall, 2),
        "poisson_1500": {"achieved_rps": round(po.request_throughput, 1), "failed": po.failed,
                         "send_lag_ms_p50": round(po.send_lag_ms.p(50), 3),
                         "send_lag_ms_p99": round(po.send_lag_ms.p(99), 3),
                         "client_cpu_us_per_request": round(po.client_cpu_us_per_request or 0, 1)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_1m_at_end": round(os.getloadavg()[0], 2),
                    "note": "client and upstream share 2 cores with other work"},
    }
    out = {"meta": harness.meta(["loadtest/", "benchmarks/loadtest_overhead.py"]), **out}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "loadtest_overhead.json").write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
