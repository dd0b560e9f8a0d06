"""What a launched engine's ring-buffer poll pause (serving/engine_polling.py) changes on a host it
shares: vLLM's own loop (poll_pause_us = 0) vs the default (yield 300 µs, then sleep 50 µs a poll).

    python benchmarks/engine_polling.py [--rounds 2]

Per round and setting, the demo engine is started as `yieldgate up` launches it, then:
- decode speed: output tokens per second per request, 1 and 3 concurrent greedy requests;
- a gateway beside it: while it relays 3 streams of 2,000 tokens from the engine, how long it
  takes to answer /readyz, asked every 0.2 s by a process of its own (what a load balancer's
  probe, or a new connection, waits).
Settings alternate within each round. Writes benchmarks/results/engine_polling.{json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  benchmarks/harness.py
from stacks import decode_rate, demo_engine  # noqa: E402  benchmarks/stacks.py

RESULTS = Path(__file__).resolve().parent / "results"

SETTINGS = {"vllm_yield_loop": 0.0, "pause_50us": 50.0}
STREAM_TOKENS = 2000

PROBE = r"""
import json, sys, time, urllib.request
times, end = [], time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    t = time.monotonic()
    try:
        urllib.request.urlopen(sys.argv[1], timeout=60).read()
    except OSError:
        pass
    times.append(time.monotonic() - t)
    time.sleep(0.2)
print(json.dumps(times))
"""


def gateway_wait(url: str, workdir: Path) -> dict:
    """How long a gateway in front of the engine takes to answer /readyz (asked by a process of
    its own every 0.2 s) while it relays 3 streams of STREAM_TOKENS tokens."""
    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.gateway.embedded import GatewayProcess
    from yieldgate.serving.config import FleetConfig, ReplicaConfig
    from yieldgate.serving.demo_model import ensure_demo_model

    config = Config(server=ServerConfig(admin_token="engine-polling-bench", data_dir=str(workdir / "data")),
                    fleet=FleetConfig(model="demo", model_path=str(ensure_demo_model()), health_interval_s=0.5,
                                      replicas=[ReplicaConfig(name="std", url=url)]))
    gw = GatewayProcess(config, workdir)

    def stream(i: int) -> None:
        with httpx.stream("POST", gw.url + "/v1/completions", timeout=300, json={
                "model": "demo", "prompt": f"neighbour {i} {time.time()}", "max_tokens": STREAM_TOKENS,
                "ignore_eos": True, "stream": True}) as r:
            for _ in r.iter_raw():
                pass

    try:
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
        started = time.monotonic()
        for t in threads:
            t.start()
        time.sleep(0.5)  # the streams are decoding
        probe = subprocess.run([sys.executable, "-c", PROBE, gw.url + "/readyz", "6"], capture_output=True,
                               text=True, timeout=600)
        for t in threads:
            t.join(600)
        streams_s = time.monotonic() - started
    finally:
        gw.stop()
    times = sorted(json.loads(probe.stdout))
    return {"max_ms": times[-1] * 1000, "p50_ms": statistics.median(times) * 1000, "probes": len(times),
            "streams_s": streams_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--port", type=int, default=8190)
    ap.add_argument("--out", default=str(RESULTS / "engine_polling"))
    a = ap.parse_args()
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            order = list(SETTINGS) if rnd % 2 == 0 else list(reversed(SETTINGS))
            for name in order:
                print(f"round {rnd + 1}/{a.rounds}: {name} ...", flush=True)
                with demo_engine(a.port, False, Path(tmp) / f"{name}.log", poll_pause_us=SETTINGS[name]) as url:
                    row = {"setting": name, "round": rnd, "poll_pause_us": SETTINGS[name],
                           "tok_s_c1": decode_rate(url, "demo", 1), "tok_s_c3": decode_rate(url, "demo", 3),
                           **gateway_wait(url, Path(tmp) / f"gw-{name}-{rnd}"),
                           "load_avg_1m": os.getloadavg()[0]}
                print("  " + json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}),
                      flush=True)
                rows.append(row)
    summary = {}
    for name in SETTINGS:
        mine = [r for r in rows if r["setting"] == name]
        summary[name] = {k: statistics.median(r[k] for r in mine)
                         for k in ("tok_s_c1", "tok_s_c3", "max_ms", "p50_ms", "streams_s")}
    out = {"meta": harness.meta(["serving/", "gateway/", "benchmarks/engine_polling.py", "benchmarks/stacks.py"],
                                setup="the demo engine; 1 and 3 concurrent 128-token requests; 3 streams of "
                                      "2,000 tokens through a gateway for the probe"),
           "rows": rows, "median": summary,
           "decode_ratio_c1": summary["pause_50us"]["tok_s_c1"] / summary["vllm_yield_loop"]["tok_s_c1"],
           "decode_ratio_c3": summary["pause_50us"]["tok_s_c3"] / summary["vllm_yield_loop"]["tok_s_c3"]}
    Path(a.out + ".json").write_text(json.dumps(out, indent=2))
    plot(out, Path(a.out + ".png"))
    print(json.dumps(out["median"], indent=1))


def plot(out: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(SETTINGS)
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, key in enumerate(("tok_s_c1", "tok_s_c3")):
        a1.bar([x + 0.4 * i for x in range(len(names))], [out["median"][n][key] for n in names], 0.4,
               label=key.replace("tok_s_c", "concurrency "))
    a1.set_xticks([x + 0.2 for x in range(len(names))], names)
    a1.set_ylabel("output tokens/s per request")
    a1.legend()
    a2.bar(names, [out["median"][n]["max_ms"] for n in names])
    a2.set_yscale("log")
    a2.set_ylabel("gateway's slowest /readyz while relaying, ms (log)")
    fig.suptitle("demo engine: vLLM's poll loop vs a 50 µs pause (medians over rounds)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
