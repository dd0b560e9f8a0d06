"""Gateway CPU per request with ten models configured vs one (docs/models.md#many-models), interleaved.

    python benchmarks/many_models_overhead.py [--runs 3 --requests 15000 --rate 500]

Each target is a gateway in its own process (`GatewayProcess`) pinned to one core, with every
per-request feature on as in benchmarks/proxy_rig.py's `full` variant: API keys, cache-aware routing
that tokenizes with the tiny demo model's tokenizer, cost, ledger, metrics. Its replicas are fake
upstreams (benchmarks/fake_upstream.py's server, one process listening on 127.0.4.1 … 127.0.4.10)
that answer at once: the figure is the gateway's own work, which is what configuring more models
could add to, so a fake upstream is the right tool here (it proves no feature).

- `one`: [fleet] `demo`, two replicas on 127.0.4.1.
- `ten`: the same [fleet] plus nine [[models]] `demo-1` … `demo-9`, two replicas each on an address
  of its own (127.0.4.2 … 127.0.4.10). Measured twice: every request to `demo` (`first`, the same
  requests as `one`'s), then requests spread over the ten models in turn (`spread`).
- `one_again`: `one`'s config again, the same-config control; its ratio to `one` is the bias of
  the rig, reported beside the ratios.

In each round the three run in that order (`ten` between the two single-model runs). The load is
proxy_rig's unary shared-prefix chat at a Poisson `--rate`, `--requests` per measured phase, from
the load tester in its own process on the other core, after a warm-up over the config's models. The
gateway's CPU time (utime + stime from /proc) over a phase, divided by its requests, is its CPU per
request, background work included (health checks and metric scrapes of every replica); that
background alone is measured first, over `--idle-s` with no load. Goal: ten / one <= 1.05 (the
median over rounds of each round's ratio), for both classes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402  benchmarks/harness.py
import proxy_rig as go  # noqa: E402  benchmarks/proxy_rig.py

GOAL_RATIO = 1.05
MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "benchmarks/many_models_overhead.py",
            "benchmarks/fake_upstream.py", "benchmarks/proxy_rig.py"]
MODELS = ["demo"] + [f"demo-{i}" for i in range(1, 10)]   # go.cleanup_redis clears yg:prefix:demo*
HOSTS = [f"127.0.4.{i + 1}" for i in range(len(MODELS))]   # model i's replicas listen on HOSTS[i]
REPLICAS_PER_MODEL = 2
TARGETS = {"one": 1, "ten": 10, "one_again": 1}


# -- the rig ---------------------------------------------------------------------------------------

def gateway_config(models: int, upstream_port: int, work: Path) -> Any:
    from yieldgate.gateway.config import Config, RequestLimits, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig

    fleets = [FleetConfig(model=name, model_path=go.MODEL_PATH, tiers={"standard": TierConfig(policy="cache_aware")},
                          replicas=[ReplicaConfig(name=f"{name}-r{j}", url=f"http://{host}:{upstream_port}",
                                                  cost_per_hour="0.40") for j in range(REPLICAS_PER_MODEL)])
              for name, host in zip(MODELS[:models], HOSTS)]
    config = Config(server=ServerConfig(admin_token=go.ADMIN_TOKEN, require_keys=True, redis_url=go.REDIS_URL,
                                        data_dir=str(work / "data")),
                    limits=RequestLimits(streams_per_key=100000), fleet=fleets[0], models=fleets[1:])
    config.pricing.ledger.journal_dir = str(work / "journal")
    config.pricing.limits.prefix = go.KEY_PREFIX
    return config


def start_upstreams(hosts: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(["taskset", "-c", go.CLIENT_CORE, go.PY, __file__, "--upstreams", ",".join(hosts), str(port)],
                            stdout=subprocess.DEVNULL)
    try:
        for host in hosts:
            go.wait_http(f"http://{host}:{port}/health", 60, proc)
    except BaseException:
        go.stop(proc)
        raise
    return proc


def serve_upstreams(hosts: list[str], port: int) -> None:
    """fake_upstream.py's server on several loopback addresses in one process: a replica host each."""
    import uvloop
    from fake_upstream import Counters, Settings, UpstreamProtocol

    async def main() -> None:
        loop = asyncio.get_running_loop()
        settings, counters = Settings(), Counters()
        servers = [await loop.create_server(lambda: UpstreamProtocol(settings, counters), host, port,
                                            backlog=4096, reuse_address=True) for host in hosts]
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for s in servers:
            s.close()

    uvloop.run(main())


def start_gateway(config: Any, work: Path, timeout_s: float = 180.0) -> Any:
    """The gateway on go.GATEWAY_CORE (every thread: taskset -a, before it starts its own), once
    every tier of every model has a routable replica."""
    from yieldgate.gateway.embedded import GatewayProcess

    gw = GatewayProcess(config, work, port=go.free_port(), wait=False)
    subprocess.run(["taskset", "-a", "-p", "-c", go.GATEWAY_CORE, str(gw.process.pid)], check=True,
                   stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    while status(gw.url) != "ok":
        if gw.process.poll() is not None or time.monotonic() > deadline:
            gw.stop()
            raise RuntimeError(f"gateway did not serve every model:\n{gw.log_path.read_text()[-3000:]}")
        time.sleep(0.3)
    return gw


def status(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=2) as r:
            return json.loads(r.read()).get("status", "")
    except (OSError, ValueError):
        return ""


def create_key(url: str) -> str:
    req = urllib.request.Request(url + "/admin/keys", data=json.dumps({"team": "bench"}).encode(), method="POST",
                                 headers={"authorization": f"Bearer {go.ADMIN_TOKEN}", "content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())["secret"]


# -- the load worker (its own process) --------------------------------------------------------------

class ModelsInTurn:
    """A workload whose sessions name `models` in turn (a session's `adapter` is the model name its
    requests send); with one model, the target's."""

    def __init__(self, workload: Any, models: list[str]):
        self.workload, self.models = workload, models

    def sessions(self):
        import msgspec

        for i, s in enumerate(self.workload.sessions()):
            yield msgspec.structs.replace(s, adapter=self.models[i % len(self.models)]) if len(self.models) > 1 else s

    def describe(self) -> dict:
        return {**self.workload.describe(), "models": self.models}


def load_worker(spec_path: str, out_path: str) -> None:
    """Each phase against one gateway; its CPU over each phase from /proc."""
    import msgspec
    import uvloop

    from yieldgate.loadtest import Bounds, Load, Runner, Target
    from yieldgate.loadtest.workload import SharedPrefixWorkload

    spec = json.loads(Path(spec_path).read_text())
    target = msgspec.convert(spec["target"], Target)
    pids = [spec["pid"]]

    async def main() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ph in spec["phases"]:
            if ph["name"] == "idle":
                cpu0, t0 = go.cpu_seconds(pids), time.perf_counter()
                await asyncio.sleep(ph["seconds"])
                cpu, wall = go.cpu_seconds(pids) - cpu0, time.perf_counter() - t0
                out.append({"name": "idle", "wall_s": wall, "gateway_cpu_s": cpu, "idle_cpu_ms_per_s": cpu / wall * 1e3})
                continue
            workload = ModelsInTurn(msgspec.convert(ph["workload"], SharedPrefixWorkload), ph["models"])
            async with Runner(target, workload, seed=0, timeout_s=60) as runner:  # type: ignore[arg-type]
                cpu0, t0 = go.cpu_seconds(pids), time.perf_counter()
                s, records, _ = await runner.run_phase(msgspec.convert(ph["load"], Load), msgspec.convert(ph["bounds"], Bounds))
                cpu, wall = go.cpu_seconds(pids) - cpu0, time.perf_counter() - t0
            row = {"name": ph["name"], "models": len(ph["models"]), "requests": s.requests, "failed": s.failed,
                   "errors": s.errors, "throughput_rps": s.request_throughput, "wall_s": wall, "gateway_cpu_s": cpu,
                   "cpu_us_per_request": cpu / s.requests * 1e6 if s.requests else None,
                   "e2e_p50_ms": s.e2e_ms.p(50) if s.completed else None,
                   "e2e_p99_ms": s.e2e_ms.p(99) if s.completed else None,
                   "served_by": dict(sorted(Counter(r.replica for r in records if r.replica).items()))}
            out.append(row)
            print(f"    {row['name']:<8} {s.completed}/{s.requests} ok, {s.request_throughput:.0f}/s, "
                  f"gateway CPU {row['cpu_us_per_request'] or 0:.0f} µs/request, p99 {row['e2e_p99_ms'] or 0:.1f} ms",
                  flush=True)
        return out

    Path(out_path).write_text(json.dumps(uvloop.run(main())))


def run_load(url: str, api_key: str, pid: int, phases: list[dict[str, Any]], work: Path) -> list[dict[str, Any]]:
    spec, out = work / "load-spec.json", work / "load-out.json"
    spec.write_text(json.dumps({"target": go.target(url, api_key), "pid": pid, "phases": phases}))
    subprocess.run(["taskset", "-c", go.CLIENT_CORE, go.PY, __file__, "--load-worker", str(spec), str(out)],
                   check=True, cwd=go.ROOT)
    return json.loads(out.read_text())


def phases(models: int, a: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm-up over the config's models (its own sessions), the idle window, then each class: the
    same seeded sessions and arrivals for `first` in every config."""
    measured = {"load": {"kind": "poisson", "rate": a.rate},
                "bounds": {"requests": a.requests, "timeout_s": 30}, "workload": {**go.UNARY_WORKLOAD, "seed": 0}}
    out = [{"name": "warmup", "models": MODELS[:models], "workload": {**go.UNARY_WORKLOAD, "seed": 1},
            "load": {"kind": "concurrency", "concurrency": 8}, "bounds": {"requests": a.warmup, "timeout_s": 30}},
           {"name": "idle", "seconds": a.idle_s},
           {"name": "first", "models": MODELS[:1], **measured}]
    if models > 1:
        out.append({"name": "spread", "models": MODELS[:models], **measured})
    return out


def one_run(label: str, a: argparse.Namespace, work: Path) -> dict[str, Any]:
    models = TARGETS[label]
    run_dir = Path(tempfile.mkdtemp(prefix=f"{label}-", dir=work))
    upstream_port = go.free_port()
    upstream = start_upstreams(HOSTS[:models], upstream_port)
    gateway = None
    try:
        go.cleanup_redis()
        gateway = start_gateway(gateway_config(models, upstream_port, run_dir), run_dir)
        print(f"  {label}: {models} model{'s' * (models > 1)}, gateway {gateway.url}", flush=True)
        rows = run_load(gateway.url, create_key(gateway.url), gateway.process.pid, phases(models, a), run_dir)
    finally:
        if gateway is not None:
            gateway.stop()
        go.stop(upstream)
    by = {r["name"]: r for r in rows}
    spread = by.get("spread", {})
    return {"models": models, "cpu_us_first": by["first"]["cpu_us_per_request"],
            "cpu_us_spread": spread.get("cpu_us_per_request"), "idle_cpu_ms_per_s": by["idle"]["idle_cpu_ms_per_s"],
            "failed": sum(r.get("failed", 0) for r in rows if r["name"] != "warmup"), "phases": rows}


def ratios(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per round: ten / one for each class, and the control's one_again / one."""
    out = []
    for i in sorted({r["round"] for r in runs}):
        r = {t: next(x for x in runs if x["round"] == i and x["target"] == t) for t in TARGETS}
        one = r["one"]["cpu_us_first"]
        out.append({"round": i, "ten_over_one_first": r["ten"]["cpu_us_first"] / one,
                    "ten_over_one_spread": r["ten"]["cpu_us_spread"] / one,
                    "control_over_one": r["one_again"]["cpu_us_first"] / one})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=harness.DEFAULT_RUNS, help="rounds of one, ten, one_again")
    p.add_argument("--requests", type=int, default=15000, help="per measured phase")
    p.add_argument("--rate", type=float, default=500, help="Poisson, requests/s")
    p.add_argument("--warmup", type=int, default=500, help="requests at concurrency 8, over the config's models")
    p.add_argument("--idle-s", type=float, default=10, help="the gateway's background CPU, no load")
    p.add_argument("--quick", action="store_true", help="1 run, 3,000 requests a phase, 3 s idle")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    if a.quick:
        a.runs, a.requests, a.idle_s = 1, 3000, 3
    from yieldgate.serving.demo_model import ensure_demo_model

    go.MODEL_PATH = str(ensure_demo_model())
    rec = harness.Recording("many_models_overhead", MEASURES, out=Path(a.out) if a.out else None)
    work = Path(tempfile.mkdtemp(prefix="yg-many-models-"))
    try:
        runs = harness.repeat({t: (lambda t=t: one_run(t, a, work)) for t in TARGETS}, n=a.runs)
    finally:
        go.cleanup_redis()
    per_round = ratios(runs)
    summary = {key: harness.summarize(r[key] for r in per_round)
               for key in ("ten_over_one_first", "ten_over_one_spread", "control_over_one")}
    met = {c: summary[f"ten_over_one_{c}"]["median"] <= GOAL_RATIO for c in ("first", "spread")}
    for r in per_round:
        print(f"round {r['round']}: ten/one {r['ten_over_one_first']:.3f} (first), {r['ten_over_one_spread']:.3f} "
              f"(spread); control one_again/one {r['control_over_one']:.3f}", flush=True)
    print(f"ten/one median {summary['ten_over_one_first']['median']:.3f} (first), "
          f"{summary['ten_over_one_spread']['median']:.3f} (spread); goal <= {GOAL_RATIO}")
    rec.write(runs=runs, ratios=per_round, summary={
        **summary, "goal_ratio": GOAL_RATIO, "met": met, "rate_rps": a.rate, "requests_per_phase": a.requests,
        "cpu_us_per_request": {"one": harness.summarize(r["cpu_us_first"] for r in runs if r["target"] == "one"),
                               "ten_first": harness.summarize(r["cpu_us_first"] for r in runs if r["target"] == "ten"),
                               "ten_spread": harness.summarize(r["cpu_us_spread"] for r in runs if r["target"] == "ten"),
                               "one_again": harness.summarize(r["cpu_us_first"] for r in runs if r["target"] == "one_again")},
        "idle_cpu_ms_per_s": harness.by_target(runs, "idle_cpu_ms_per_s"),
        "failed": sum(r["failed"] for r in runs)},
        setup=f"gateway (`full` features: keys, cache_aware routing with the tiny model's tokenizer, ledger, metrics) "
              f"on core {go.GATEWAY_CORE} with 1 or 10 models, {REPLICAS_PER_MODEL} fake-upstream replicas each "
              f"(127.0.4.x); unary shared-prefix chat, Poisson {a.rate:g} RPS, {a.requests} requests a measured phase "
              f"after {a.warmup} warm-up requests and {a.idle_s:g} s idle; load tester and upstream on core "
              f"{go.CLIENT_CORE}; {a.runs} rounds of one, ten, one_again")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--load-worker"]:
        load_worker(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["--upstreams"]:
        serve_upstreams(sys.argv[2].split(","), int(sys.argv[3]))
    else:
        main()
