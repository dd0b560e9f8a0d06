"""Gateway overhead, side by side: direct to a fake upstream vs yieldgate vs the Rust routers
(vllm-router, smg) vs LiteLLM proxy.

Same machine, same fake upstream (benchmarks/fake_upstream.py), same seeded load from the project's
own load tester (in its own process), one run. The gateway under test is pinned to core 1 with
`taskset -c 1`; the upstream and the load generator share core 0.

    python benchmarks/gateway_overhead.py --quick          # ~6 min
    python benchmarks/gateway_overhead.py                  # full: ~15-20 min (100k-request RSS run)
    python benchmarks/gateway_overhead.py --skip-litellm --skip-routers   # yieldgate only

Reports (JSON, markdown table, PNG in benchmarks/results/gateway_overhead*):
- added latency (gateway - direct) p50/p99 at fixed open-loop Poisson rates (100, 500, 1000 RPS)
- max sustainable RPS per gateway core (rate sweep; a step fails on >1% errors, achieved < 90% of
  offered, or p99 > max(5x the first step's, 50 ms)) and gateway CPU-µs per request (1/that is the
  CPU-bound request rate per core, independent of the load generator's own limit)
- per-chunk added latency for streams (ITL difference), 1,000 concurrent streams (errors)
- yieldgate RSS after 20k and 100k requests (quick mode: 4k and 20k)
- yieldgate with each switchable feature turned off, and the floor: uvicorn and yieldgate's upstream
  client with nothing else (benchmarks/python_floor.py), what the stack costs before yieldgate's work.

The peers are pinned versions, each installed with pip into a venv of its own under
~/.cache/yieldgate/bench-venvs (YIELDGATE_BENCH_VENVS; created on first use, then reused): LiteLLM,
and vLLM's router and Shepherd Model Gateway (Rust, round robin over the same two upstream replicas
as yieldgate's, no tokenizer, on 127.0.0.1). Every target gets the same phases from the same load
generator in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PY = sys.executable
BENCH_VENVS = Path(os.environ.get("YIELDGATE_BENCH_VENVS", "~/.cache/yieldgate/bench-venvs")).expanduser()
LITELLM_SPEC = "litellm[proxy]==1.108.*"
MODEL_PATH = ""  # set in main(): the generated demo model (its tokenizer drives cache-aware routing)
# YIELDGATE_BENCH_REDIS_URL: one Redis DB per engineer on a shared machine.
REDIS_URL = os.environ.get("YIELDGATE_BENCH_REDIS_URL", "redis://127.0.0.1:6379/12")
KEY_PREFIX = "ygbench:"
MASTER_KEY = "sk-bench-master-key"
ADMIN_TOKEN = "bench-admin-token"
GATEWAY_CORE, CLIENT_CORE = "1", "0"

# The request shape: a chat with a shared 256-token system prompt (so cache-aware routing has
# something to tokenize), 16 output tokens non-streamed, 32 streamed.
UNARY_WORKLOAD = {"kind": "shared_prefix", "tenants": 4, "prefix_tokens": 256, "users_per_tenant": 8,
                  "user_context_tokens": 32, "suffix_tokens": 32, "output_tokens": 16}
STREAM_WORKLOAD = dict(UNARY_WORKLOAD, output_tokens=32)
UPSTREAM_ITL_MS = 10.0   # per-token interval of streams (unary answers come at once)


# -- processes ---------------------------------------------------------------------------------------

# YIELDGATE_BENCH_PORTS="22500-22599" keeps every port this benchmark opens in a range (machines
# shared by several engineers); without it the kernel picks free ephemeral ports.
_PORT_RANGE = os.environ.get("YIELDGATE_BENCH_PORTS", "")
_next_port = int(_PORT_RANGE.split("-")[0]) if _PORT_RANGE else 0


def free_port() -> int:
    global _next_port
    if not _PORT_RANGE:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]
    first, last = (int(x) for x in _PORT_RANGE.split("-"))
    for _ in range(last - first + 1):
        port, _next_port = _next_port, first + (_next_port + 1 - first) % (last - first + 1)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {_PORT_RANGE}")


def wait_http(url: str, timeout: float = 120.0, proc: subprocess.Popen | None = None,
              headers: dict[str, str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=2) as r:
                if r.status < 500:
                    return
        except Exception:
            time.sleep(0.3)
    raise RuntimeError(f"{url} not ready after {timeout:.0f}s")


def stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def descendants(pid: int) -> list[int]:
    """pid and all its children (LiteLLM may fork a worker)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except (OSError, IndexError):
            pass
    return total / os.sysconf("SC_CLK_TCK")


def rss_mib(pids: list[int]) -> float:
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def start_upstream(port: int) -> subprocess.Popen:
    proc = subprocess.Popen(
        ["taskset", "-c", CLIENT_CORE, PY, str(ROOT / "benchmarks" / "fake_upstream.py"), "--port", str(port),
         "--ttft-ms", "0", "--itl-ms", str(UPSTREAM_ITL_MS), "--tokens", "64"],
        stdout=subprocess.DEVNULL)
    wait_http(f"http://127.0.0.1:{port}/health", 20, proc)
    return proc


# -- yieldgate -----------------------------------------------------------------------------------------

VARIANTS: dict[str, dict[str, Any]] = {
    # Everything on: cache-aware routing (tokenizes every prompt), API keys, cost, ledger, metrics.
    "full": {"policy": "cache_aware", "require_keys": True},
    "no_tokenize": {"policy": "round_robin", "require_keys": True},
    "no_auth": {"policy": "cache_aware", "require_keys": False},
    "no_ledger": {"policy": "cache_aware", "require_keys": True, "ledger": False},
    "no_metrics": {"policy": "cache_aware", "require_keys": True, "request_metrics": False},
    "minimal": {"policy": "round_robin", "require_keys": False},
    # Only what no switch turns off: parsing, tiers, routing (round robin), pricing, forwarding.
    "bare": {"policy": "round_robin", "require_keys": False, "ledger": False, "request_metrics": False},
}
VARIANT_ORDER = ("no_tokenize", "no_auth", "no_ledger", "no_metrics", "minimal", "bare")


def gateway_config(port: int, upstream: str, workdir: Path, policy: str, require_keys: bool,
                   ledger: bool = True, request_metrics: bool = True) -> str:
    replicas = "\n".join(
        f'[[fleet.replicas]]\nname = "fake-{i}"\ntier = "standard"\nurl = "{upstream}"\ncost_per_hour = "0.40"\n'
        for i in range(2))
    return f"""
[server]
host = "127.0.0.1"
port = {port}
admin_token = "{ADMIN_TOKEN}"
require_keys = {str(require_keys).lower()}
ledger = {str(ledger).lower()}
request_metrics = {str(request_metrics).lower()}
redis_url = "{REDIS_URL}"
data_dir = "{workdir}/data"

[limits]
streams_per_key = 100000

[fleet]
model = "demo"
model_path = "{MODEL_PATH}"
health_interval_s = 2.0
scrape_interval_s = 2.0

[fleet.tiers.standard]
policy = "{policy}"

{replicas}

[pricing.ledger]
journal_dir = "{workdir}/journal"

[pricing.limits]
prefix = "{KEY_PREFIX}"
"""


class Target:
    """A gateway under test: one process (and its children) on the gateway core."""

    proc: subprocess.Popen

    def _wait_up(self, url: str, timeout: float) -> None:
        """Until `url` answers; a target that never comes up must not outlive the run."""
        try:
            wait_http(url, timeout, self.proc)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return descendants(self.proc.pid)

    def close(self) -> None:
        stop(self.proc)

    stop = close  # as GatewayProcess.stop: a benchmark holding either kind stops it one way


class Yieldgate(Target):
    def __init__(self, upstream: str, workdir: Path, variant: str, code: Path = ROOT):
        """`code`: the checkout whose gateway runs (another worktree, to compare code versions)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        v = VARIANTS[variant]
        self.workdir = workdir / f"yg-{variant}"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        cfg = self.workdir / "gateway.toml"
        cfg.write_text(gateway_config(self.port, upstream, self.workdir, **v))
        env = {k: val for k, val in os.environ.items() if not k.startswith("YIELDGATE_")}
        env["YIELDGATE_HOME"] = str(self.workdir)
        # Another checkout runs with its own venv's python: an editable install maps `yieldgate` to
        # one checkout, whatever the working directory.
        python = code / ".venv" / "bin" / "python" if code != ROOT and (code / ".venv").is_dir() else Path(PY)
        self.proc = subprocess.Popen(["taskset", "-c", GATEWAY_CORE, str(python), "-m", "yieldgate.gateway.cli", "gateway", "--config", str(cfg)],
                                     cwd=code, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "gateway.log", "wb"))
        self._wait_up(self.url + "/healthz", 60)
        self.api_key: str | None = None
        if v["require_keys"]:
            self.api_key = self._create_key()

    def _create_key(self) -> str:
        req = urllib.request.Request(self.url + "/admin/keys", data=json.dumps({"team": "bench"}).encode(),
                                     headers={"authorization": f"Bearer {ADMIN_TOKEN}",
                                              "content-type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())["secret"]


class PythonFloor(Target):
    """benchmarks/python_floor.py: uvicorn and yieldgate's upstream client with nothing else, over
    the same two replicas; what the stack costs before any of yieldgate's work."""

    def __init__(self, upstream: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        self.proc = subprocess.Popen(["taskset", "-c", GATEWAY_CORE, PY, str(ROOT / "benchmarks" / "python_floor.py"),
                                      str(self.port), upstream, upstream], cwd=ROOT)
        self._wait_up(self.url + "/health", 30)


# -- peers, each in a venv of its own --------------------------------------------------------------------

def bench_venv(spec: str) -> Path:
    """A venv holding the pip requirement `spec` (a pinned version), created once and reused."""
    venv = BENCH_VENVS / re.sub(r"[^A-Za-z0-9.]+", "-", spec).strip("-")
    if not (venv / "installed").exists():
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(venv / "bin" / "pip"), "install", "-q", spec], check=True)
        (venv / "installed").write_text(spec + "\n")
    return venv


def installed_version(venv: Path, dist: str) -> str:
    return subprocess.run([str(venv / "bin" / "python"), "-c", f"import importlib.metadata as m; print(m.version({dist!r}))"],
                          capture_output=True, text=True, check=True).stdout.strip()


# -- LiteLLM ---------------------------------------------------------------------------------------------

class LiteLLM(Target):
    def __init__(self, upstream: str, workdir: Path):
        venv = bench_venv(LITELLM_SPEC)
        exe = venv / "bin" / "litellm"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = MASTER_KEY
        d = workdir / "litellm"
        d.mkdir(parents=True, exist_ok=True)
        cfg = d / "config.yaml"
        cfg.write_text(f"""model_list:
  - model_name: demo
    litellm_params:
      model: openai/demo
      api_base: {upstream}/v1
      api_key: fake
litellm_settings:
  set_verbose: false
  json_logs: false
  turn_off_message_logging: true
  drop_params: true
general_settings:
  master_key: {MASTER_KEY}
  disable_spend_logs: true
  disable_error_logs: true
""")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "REDIS"))}
        env.update(LITELLM_MASTER_KEY=MASTER_KEY, LITELLM_LOG="ERROR", LITELLM_LOCAL_MODEL_COST_MAP="True",
                   DISABLE_ADMIN_UI="True", NO_DOCS="True", LITELLM_TELEMETRY="False")
        self.version = installed_version(venv, "litellm")
        self.proc = subprocess.Popen(
            ["taskset", "-c", GATEWAY_CORE, str(exe), "--config", str(cfg), "--host", "127.0.0.1",
             "--port", str(self.port), "--num_workers", "1"],
            cwd=d, env=env, stdout=open(d / "litellm.log", "wb"), stderr=subprocess.STDOUT)
        self._wait_up(self.url + "/health/liveliness", 180)

    def close(self) -> None:
        # LiteLLM's worker processes can outlive their parent and keep core 1 busy, which made
        # the yieldgate variants measured after it look slower than yieldgate itself.
        tree = self.pids
        stop(self.proc)
        for pid in tree[1:]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


# -- the Rust routers ------------------------------------------------------------------------------------

# Pinned: a new release is a new comparison. Both are Rust servers shipped as wheels with a Python
# launcher; each round-robins over the same two replicas as yieldgate, with no tokenizer and no
# credential check (what yieldgate's `minimal` variant does, while its "yieldgate" row has every
# feature on).
ROUTERS: dict[str, dict[str, Any]] = {
    "vllm-router": {"spec": "vllm-router==0.1.17", "argv": [], "log_level": "warning"},
    "smg": {"spec": "smg==1.13.0", "argv": ["launch", "--disable-tokenizer-autoload"], "log_level": "warn"},
}


class RustRouter(Target):
    """A pinned Rust router from its own venv, on loopback, in front of `upstreams` (the same
    upstream twice in the overhead benchmark: two workers behind one engine). `pin`: on the
    gateway core, like every target here; the routing benchmark leaves it unpinned."""

    def __init__(self, name: str, upstreams: list[str], workdir: Path, policy: str = "round_robin",
                 pin: bool = True):
        spec = ROUTERS[name]
        venv = bench_venv(spec["spec"])
        self.version = installed_version(venv, name)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        d = workdir / f"{name}-{policy}-{self.port}"
        d.mkdir(parents=True, exist_ok=True)
        self.log_path = d / "router.log"
        # Every listener on loopback: the router and its Prometheus exporter (smg binds that one
        # to 0.0.0.0 unless told).
        argv = [str(venv / "bin" / name), *spec["argv"], "--host", "127.0.0.1", "--port", str(self.port),
                "--worker-urls", *upstreams, "--policy", policy,
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--log-level", spec["log_level"]]
        self.proc = subprocess.Popen(["taskset", "-c", GATEWAY_CORE, *argv] if pin else argv, cwd=d,
                                     stdin=subprocess.DEVNULL, stdout=open(self.log_path, "wb"),
                                     stderr=subprocess.STDOUT)
        try:
            self._wait_up(self.url + "/health", 120)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; {name}'s log ends:\n{self.log_path.read_text()[-3000:]}") from None


# -- the load worker (its own process) ----------------------------------------------------------------

def load_worker(spec_path: str, out_path: str) -> None:
    """Run phases against one target with loadtest; sample the watched pids' CPU and RSS per phase."""
    import gc

    import msgspec

    from yieldgate.loadtest import Bounds, Load, Runner, Target
    from yieldgate.loadtest.workload import SharedPrefixWorkload

    spec = json.loads(Path(spec_path).read_text())
    target = msgspec.convert(spec["target"], Target)
    pids: list[int] = spec.get("pids", [])

    import asyncio

    async def main() -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        runners: dict[str, Runner] = {}
        first_p99: dict[str, float] = {}
        failed_groups: set[str] = set()
        try:
            for ph in spec["phases"]:
                group = ph.get("sweep")
                if group and group in failed_groups:
                    continue
                # A sweep gets a connection pool of its own, after a pause: connections left idle by
                # an overloaded fixed-rate phase get closed by the server's keep-alive timeout
                # while the client still holds them, and reusing one fails the first sweep step.
                wkey = json.dumps(ph["workload"], sort_keys=True) + (group or "")
                if group and wkey not in runners:
                    await asyncio.sleep(SWEEP_SETTLE_S)
                if wkey not in runners:
                    runners[wkey] = Runner(target, msgspec.convert(ph["workload"], SharedPrefixWorkload),
                                           seed=0, timeout_s=60)
                    await runners[wkey].__aenter__()
                load = msgspec.convert(ph["load"], Load)
                bounds = msgspec.convert(ph["bounds"], Bounds)
                # No collector pass inside a measured phase: with the previous phases' records alive a
                # full pass stalled this process 40-60 ms (30 s at 500 RPS: one or two per phase), and
                # every request in flight then looked that much slower, through a gateway or not.
                gc.collect()
                gc.freeze()
                gc.disable()
                cpu0, t0 = cpu_seconds(pids), time.perf_counter()
                try:
                    summary, records, duration = await runners[wkey].run_phase(load, bounds)
                finally:
                    gc.enable()
                cpu = cpu_seconds(pids) - cpu0
                wall = time.perf_counter() - t0
                s = msgspec.to_builtins(summary)
                n = summary.requests + summary.warmup
                row = {"name": ph["name"], "summary": s, "gateway_cpu_s": cpu, "wall_s": wall,
                       "gateway_cpu_us_per_request": cpu / n * 1e6 if n and pids else None,
                       "rss_mib": rss_mib(pids) if pids else None}
                if group:
                    err = summary.failed / max(summary.requests, 1)
                    p99 = summary.e2e_ms.p(99) if summary.completed else float("inf")
                    first_p99.setdefault(group, p99)
                    offered = ph["load"].get("rate") or 0
                    achieved = summary.request_throughput
                    reason = None
                    if err > 0.01:
                        reason = f"error rate {err:.1%}"
                    elif offered and achieved < 0.9 * offered:
                        reason = f"achieved {achieved:.0f} < 90% of {offered:.0f}"
                    elif p99 > max(5 * first_p99[group], 50.0):
                        reason = f"p99 {p99:.1f} ms blew up"
                    row["fail_reason"] = reason
                    if reason:
                        failed_groups.add(group)
                out.append(row)
                print(f"  {ph['name']:<24} ok={summary.completed}/{summary.requests} "
                      f"thr={summary.request_throughput:.0f}/s e2e p50={_p(summary.e2e_ms, 50)} "
                      f"p99={_p(summary.e2e_ms, 99)} itl p50={_p(summary.itl_ms, 50)} "
                      f"cpu/req={row['gateway_cpu_us_per_request'] or 0:.0f}us "
                      f"errors={summary.errors}" + (f" FAIL: {row.get('fail_reason')}" if row.get("fail_reason") else ""),
                      flush=True)
        finally:
            for r in runners.values():
                await r.__aexit__(None, None, None)
        return out

    try:
        import uvloop  # the load generator's own overhead matters at 1k+ RPS
        result = uvloop.run(main())
    except ImportError:  # pragma: no cover
        result = asyncio.run(main())
    Path(out_path).write_text(json.dumps(result))


def _p(dist: Any, q: float) -> str:
    return f"{dist.p(q):.2f}" if dist.count else "-"


def run_phases(target: dict[str, Any], phases: list[dict[str, Any]], pids: list[int], workdir: Path) -> list[dict]:
    spec = workdir / f"spec-{time.monotonic_ns()}.json"
    out = spec.with_suffix(".out.json")
    spec.write_text(json.dumps({"target": target, "phases": phases, "pids": pids}))
    subprocess.run(["taskset", "-c", CLIENT_CORE, PY, __file__, "--load-worker", str(spec), str(out)],
                   check=True, cwd=ROOT)
    return json.loads(out.read_text())


# -- the plan ----------------------------------------------------------------------------------------------

def plan(mode: dict[str, Any], sweep_rates: list[float], streams: bool = True,
         rates: tuple[float, ...] = (100, 500, 1000)) -> list[dict[str, Any]]:
    fixed_s = mode["fixed_s"]
    phases: list[dict[str, Any]] = [
        {"name": "warmup", "workload": UNARY_WORKLOAD, "load": {"kind": "concurrency", "concurrency": 8},
         "bounds": {"requests": 300}},
    ]
    for rate in rates:
        phases.append({"name": f"fixed_{rate:g}", "workload": UNARY_WORKLOAD,
                       "load": {"kind": "poisson", "rate": rate},
                       "bounds": {"requests": None, "duration_s": fixed_s, "timeout_s": 30}})
    for rate in sweep_rates:
        phases.append({"name": f"sweep_{rate:g}", "sweep": "max_rps", "workload": UNARY_WORKLOAD,
                       "load": {"kind": "poisson", "rate": rate},
                       "bounds": {"requests": None, "duration_s": mode["sweep_s"], "timeout_s": 30}})
    if streams:
        phases.append({"name": "streams_itl", "workload": STREAM_WORKLOAD,
                       "load": {"kind": "concurrency", "concurrency": 32},
                       "bounds": {"requests": mode["itl_requests"]}})
        phases.append({"name": "streams_1000", "workload": STREAM_WORKLOAD,
                       "load": {"kind": "concurrency", "concurrency": 1000},
                       "bounds": {"requests": mode["streams_requests"], "timeout_s": 60}})
    return phases


def target(url: str, api_key: str | None, stream: bool = False) -> dict[str, Any]:
    return {"base_url": url, "model": "demo", "api": "chat", "stream": stream, "api_key": api_key}


LOADAVG: dict[str, list[float]] = {}  # 1-minute load average before and after each target


def run_target(name: str, url: str, api_key: str | None, pids: list[int], mode: dict, workdir: Path,
               sweep_rates: list[float], streams: bool = True) -> dict[str, Any]:
    LOADAVG[name] = [os.getloadavg()[0]]
    print(f"== {name} (load average {LOADAVG[name][0]:.2f})", flush=True)
    phases = plan(mode, sweep_rates, streams)
    unary = [p for p in phases if not p["name"].startswith("streams")]
    stream = [p for p in phases if p["name"].startswith("streams")]
    rows = run_phases(target(url, api_key), unary, pids, workdir)
    if stream:
        rows += run_phases(target(url, api_key, stream=True), stream, pids, workdir)
    LOADAVG[name].append(os.getloadavg()[0])
    return {r["name"]: r for r in rows}


def rss_run(url: str, api_key: str | None, pids: list[int], mode: dict, workdir: Path) -> dict[str, Any]:
    n1, n2 = mode["rss_requests"]
    phases = [{"name": f"rss_{n1}", "workload": UNARY_WORKLOAD, "load": {"kind": "concurrency", "concurrency": 64},
               "bounds": {"requests": n1}},
              {"name": f"rss_{n2}", "workload": UNARY_WORKLOAD, "load": {"kind": "concurrency", "concurrency": 64},
               "bounds": {"requests": n2 - n1}}]
    print(f"== yieldgate RSS over {n2} requests", flush=True)
    rows = run_phases(target(url, api_key), phases, pids, workdir)
    a, b = rows[0]["rss_mib"], rows[1]["rss_mib"]
    return {"requests": [n1, n2], "rss_mib": [a, b], "growth_pct": (b - a) / a * 100 if a else None,
            "errors": rows[0]["summary"]["failed"] + rows[1]["summary"]["failed"]}


def cleanup_redis() -> None:
    try:
        import redis
        r = redis.Redis.from_url(REDIS_URL)
        for pattern in (KEY_PREFIX + "*", "yg:prefix:demo*"):
            keys = list(r.scan_iter(pattern, count=1000))
            if keys:
                r.delete(*keys)
        r.close()
    except Exception as exc:  # cleanup is best effort
        print(f"redis cleanup failed: {exc}")


# -- report ------------------------------------------------------------------------------------------------

def _dist(row: dict | None, metric: str, q: str) -> float | None:
    if not row:
        return None
    d = row["summary"][metric]
    return d["percentiles"].get(q) if d["count"] else None


def max_rps(rows: dict[str, dict]) -> dict[str, Any]:
    steps = [r for k, r in rows.items() if k.startswith("sweep_")]
    ok = [r for r in steps if not r.get("fail_reason")]
    best = max(ok, key=lambda r: r["summary"]["request_throughput"], default=None)
    failed = next((r for r in steps if r.get("fail_reason")), None)
    return {"max_sustained_rps": best["summary"]["request_throughput"] if best else 0.0,
            "at_offered_rps": best["summary"]["offered_rate"] if best else None,
            "stopped_at": failed["name"] if failed else None,
            "stop_reason": failed.get("fail_reason") if failed else "load generator limit (no failure)"}


def analyse(results: dict[str, Any]) -> dict[str, Any]:
    direct = results["targets"]["direct"]
    table: dict[str, Any] = {}
    for name, rows in results["targets"].items():
        t: dict[str, Any] = {}
        for rate in (100, 500, 1000):
            row = rows.get(f"fixed_{rate}")
            base = direct.get(f"fixed_{rate}")
            entry = {"p50_ms": _dist(row, "e2e_ms", "p50"), "p99_ms": _dist(row, "e2e_ms", "p99"),
                     "errors": row["summary"]["failed"] if row else None,
                     "achieved_rps": row["summary"]["request_throughput"] if row else None,
                     "gateway_cpu_us_per_request": row.get("gateway_cpu_us_per_request") if row else None}
            if name != "direct" and row and base:
                entry["added_p50_ms"] = entry["p50_ms"] - _dist(base, "e2e_ms", "p50")
                entry["added_p99_ms"] = entry["p99_ms"] - _dist(base, "e2e_ms", "p99")
            t[f"{rate}rps"] = entry
        t["max_rps"] = max_rps(rows) if any(k.startswith("sweep_") for k in rows) else None
        cpu = (t.get("500rps") or {}).get("gateway_cpu_us_per_request")
        t["cpu_bound_rps_per_core"] = 1e6 / cpu if cpu else None
        itl, base_itl = rows.get("streams_itl"), direct.get("streams_itl")
        if itl:
            t["streams"] = {"itl_p50_ms": _dist(itl, "itl_ms", "p50"), "itl_p99_ms": _dist(itl, "itl_ms", "p99"),
                            "itl_mean_ms": itl["summary"]["itl_ms"]["mean"] if itl["summary"]["itl_ms"]["count"] else None,
                            "ttft_p50_ms": _dist(itl, "ttft_ms", "p50"), "errors": itl["summary"]["failed"]}
            if name != "direct" and base_itl:
                t["streams"]["added_itl_p50_ms"] = t["streams"]["itl_p50_ms"] - _dist(base_itl, "itl_ms", "p50")
                t["streams"]["added_itl_p99_ms"] = t["streams"]["itl_p99_ms"] - _dist(base_itl, "itl_ms", "p99")
                t["streams"]["added_itl_mean_ms"] = t["streams"]["itl_mean_ms"] - base_itl["summary"]["itl_ms"]["mean"]
                t["streams"]["added_ttft_p50_ms"] = t["streams"]["ttft_p50_ms"] - _dist(base_itl, "ttft_ms", "p50")
        s1k = rows.get("streams_1000")
        if s1k:
            t["streams_1000"] = {"requests": s1k["summary"]["requests"], "errors": s1k["summary"]["failed"],
                                 "error_kinds": s1k["summary"]["errors"], "e2e_p99_ms": _dist(s1k, "e2e_ms", "p99")}
        table[name] = t
    yg, ll = table.get("yieldgate"), table.get("litellm")
    goals: dict[str, Any] = {}
    if yg:
        a = yg["500rps"]
        goals["p50_added_le_1ms_at_500"] = a.get("added_p50_ms") is not None and a["added_p50_ms"] <= 1.0
        goals["p99_added_le_5ms_at_500"] = a.get("added_p99_ms") is not None and a["added_p99_ms"] <= 5.0
    if yg and ll:
        ya, la = yg["500rps"].get("added_p50_ms"), ll["500rps"].get("added_p50_ms")
        goals["p50_overhead_ratio_litellm_over_yieldgate_at_500"] = la / ya if ya and la and ya > 0 else None
        yr, lr = (yg["max_rps"] or {}).get("max_sustained_rps"), (ll["max_rps"] or {}).get("max_sustained_rps")
        goals["max_rps_ratio_yieldgate_over_litellm"] = yr / lr if yr and lr else None
        yc, lc = yg.get("cpu_bound_rps_per_core"), ll.get("cpu_bound_rps_per_core")
        goals["cpu_bound_rps_ratio_yieldgate_over_litellm"] = yc / lc if yc and lc else None
    routers = [n for n in ROUTERS if n in table]
    if yg and routers:
        # The goal: every feature on, no more CPU per request and no more added latency than the
        # fastest Rust router, at 500 and 1,000 RPS.
        for rate in (500, 1000):
            at = f"{rate}rps"
            cpu = {n: table[n][at]["gateway_cpu_us_per_request"] for n in routers}
            fastest = min(routers, key=lambda n: cpu[n] or float("inf"))
            mine = yg[at]["gateway_cpu_us_per_request"]
            goals[f"fastest_router_at_{rate}"] = fastest
            goals[f"cpu_ratio_yieldgate_over_fastest_router_at_{rate}"] = mine / cpu[fastest] if mine and cpu[fastest] else None
            for q in ("p50", "p99"):
                best = min((table[n][at].get(f"added_{q}_ms") for n in routers), key=lambda v: float("inf") if v is None else v)
                ours = yg[at].get(f"added_{q}_ms")
                goals[f"added_{q}_ms_yieldgate_minus_best_router_at_{rate}"] = ours - best if ours is not None and best is not None else None
    return {"table": table, "goals": goals}


def result_meta(results: dict[str, Any]) -> dict[str, Any]:
    import harness  # benchmarks/harness.py, beside this script

    pairs = list(results.get("loadavg_1min", {}).values())  # (before, after) per target, in run order
    meta = harness.meta(["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/gateway_overhead.py", "benchmarks/fake_upstream.py"],
                        load_before=pairs[0][0] if pairs else None,
                        versions={"litellm": results.get("litellm_version"), **results.get("versions", {})})
    meta["load_avg_1m"]["samples"] = pairs
    return meta


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def markdown(results: dict[str, Any]) -> str:
    a = results["analysis"]
    t = a["table"]
    lines = [f"# Gateway overhead ({results['mode']} mode, {time.strftime('%Y-%m-%d %H:%M', time.localtime(results['started_at']))})",
             "", f"Machine: {os.cpu_count()} cores; gateway pinned to core {GATEWAY_CORE}, fake upstream + "
             f"load generator on core {CLIENT_CORE}. Chat requests, ~1.5 KB prompt, 16 output tokens (unary). "
             f"yieldgate with every feature on (cache-aware routing with tokenization, API key, cost, ledger, metrics); "
             + "".join(f"{n} {v} (round robin); " for n, v in results.get("versions", {}).items())
             + f"LiteLLM {results.get('litellm_version') or '-'}. 1-minute load average before/after each "
             f"target: " + ", ".join(f"{k} {v[0]:.2f}/{v[-1]:.2f}" for k, v in results.get("loadavg_1min", {}).items())
             + " (2 cores; the machine is shared with other engineers, whose runs take the same lock)."
             + (" LiteLLM was measured in a second run against the same upstream settings, "
                f"{(results['litellm_separate_run_at'] - results['started_at']) / 60:.0f} min after the first."
                if results.get("litellm_separate_run_at") else "")
             + (" yieldgate's rate sweep was run again then too, with the same procedure as LiteLLM's."
                if results.get("yieldgate_sweep_rerun") else ""), "",
             "## Added latency over direct (ms), open-loop Poisson", "",
             "| target | rate | p50 | p99 | added p50 | added p99 | errors | gateway CPU µs/req |",
             "|---|---|---|---|---|---|---|---|"]
    for name, row in t.items():
        for rate in (100, 500, 1000):
            e = row[f"{rate}rps"]
            lines.append(f"| {name} | {rate} | {_f(e['p50_ms'])} | {_f(e['p99_ms'])} | {_f(e.get('added_p50_ms'))} | "
                         f"{_f(e.get('added_p99_ms'))} | {_f(e['errors'])} | {_f(e['gateway_cpu_us_per_request'], 0)} |")
    lines += ["", "## Capacity per gateway core", "",
              "| target | max sustained RPS (sweep) | stopped at | why | CPU-bound RPS/core (1e6 / CPU-µs per req at 500 RPS) |",
              "|---|---|---|---|---|"]
    for name, row in t.items():
        m = row.get("max_rps") or {}
        lines.append(f"| {name} | {_f(m.get('max_sustained_rps'), 0)} | {_f(m.get('stopped_at'))} | "
                     f"{_f(m.get('stop_reason'))} | {_f(row.get('cpu_bound_rps_per_core'), 0)} |")
    lines += ["", f"## Streams (upstream ITL {UPSTREAM_ITL_MS:g} ms, 32 tokens, 32 concurrent; then 1,000 concurrent)", "",
              "| target | ITL p50 | ITL p99 | added ITL p50 | added ITL p99 | added ITL mean | added TTFT p50 | 1,000 concurrent: requests / errors |",
              "|---|---|---|---|---|---|---|---|"]
    for name, row in t.items():
        s = row.get("streams") or {}
        k = row.get("streams_1000") or {}
        lines.append(f"| {name} | {_f(s.get('itl_p50_ms'))} | {_f(s.get('itl_p99_ms'))} | {_f(s.get('added_itl_p50_ms'), 3)} | "
                     f"{_f(s.get('added_itl_p99_ms'), 3)} | {_f(s.get('added_itl_mean_ms'), 3)} | {_f(s.get('added_ttft_p50_ms'))} | "
                     f"{_f(k.get('requests'))} / {_f(k.get('errors'))} {k.get('error_kinds') or ''} |")
    rss = results.get("rss")
    if rss:
        lines += ["", "## yieldgate memory", "",
                  f"RSS after {rss['requests'][0]:,} requests: {rss['rss_mib'][0]:.1f} MiB; after "
                  f"{rss['requests'][1]:,}: {rss['rss_mib'][1]:.1f} MiB; growth {_f(rss['growth_pct'])}% "
                  f"(goal < 5%); errors {rss['errors']}."]
    var = results.get("variants") or {}
    if var:
        lines += ["", "## yieldgate features switched off, and the floor (500 RPS)", "",
                  "| variant | added p50 | added p99 | CPU µs/req | CPU-bound RPS/core |", "|---|---|---|---|---|"]
        base = results["targets"]["direct"]["fixed_500"]
        for name, r in var.items():
            row = r["fixed_500"]
            cpu = row.get("gateway_cpu_us_per_request")
            what = VARIANTS.get(name) or "benchmarks/python_floor.py: uvicorn + the upstream client, nothing else"
            lines.append(f"| {name} ({what}) | {_f(_dist(row, 'e2e_ms', 'p50') - _dist(base, 'e2e_ms', 'p50'))} | "
                         f"{_f(_dist(row, 'e2e_ms', 'p99') - _dist(base, 'e2e_ms', 'p99'))} | {_f(cpu, 0)} | "
                         f"{_f(1e6 / cpu if cpu else None, 0)} |")
        lines += ["", "Cost pricing has no switch (the response carries the cost): it is on in every variant."]
    lines += ["", "## Goals", ""] + [f"- {k}: {_f(v)}" for k, v in a["goals"].items()]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = results["analysis"]["table"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    names = [n for n in t if n != "direct"]
    rates = [100, 500, 1000]
    width = 0.8 / max(len(names), 1)
    for ax, q in zip(axes[:2], ("p50", "p99")):
        for i, n in enumerate(names):
            vals = [t[n][f"{r}rps"].get(f"added_{q}_ms") or 0 for r in rates]
            ax.bar([x + i * width for x in range(3)], vals, width, label=n)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(3)], [f"{r} RPS" for r in rates])
        ax.set_ylabel("ms added over direct")
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(f"added {q} latency")
        ax.legend()
    ax = axes[2]
    for n, rows in results["targets"].items():
        steps = [r for k, r in rows.items() if k.startswith("sweep_")]
        xs = [r["summary"]["offered_rate"] for r in steps]
        ys = [r["summary"]["e2e_ms"]["percentiles"].get("p99") if r["summary"]["e2e_ms"]["count"] else None for r in steps]
        ax.plot(xs, ys, marker="o", label=n)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("offered RPS")
    ax.set_ylabel("p99 e2e ms")
    ax.set_title("rate sweep (gateway on 1 core)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main ----------------------------------------------------------------------------------------------------

MODES = {
    "quick": {"fixed_s": 5.0, "sweep_s": 4.0, "itl_requests": 200, "streams_requests": 1000,
              "rss_requests": (4000, 20000)},
    "full": {"fixed_s": 20.0, "sweep_s": 8.0, "itl_requests": 1000, "streams_requests": 3000,
             "rss_requests": (20000, 100000)},
    "smoke": {"fixed_s": 1.0, "sweep_s": 1.0, "itl_requests": 50, "streams_requests": 300,
              "rss_requests": (500, 1000)},
}
SWEEP_SETTLE_S = 10.0  # pause before a rate sweep, so the previous phase's backlog drains
SWEEP = [250, 500, 750, 1000, 1500, 2000, 2500, 3000, 4000]
SWEEP_SLOW = [50, 100, 150, 200, 300, 400, 500, 750, 1000]


def main() -> None:
    global MODEL_PATH
    from yieldgate.serving.demo_model import ensure_demo_model
    MODEL_PATH = str(ensure_demo_model())
    p = argparse.ArgumentParser(description="gateway overhead: direct vs yieldgate vs the Rust routers vs LiteLLM")
    p.add_argument("--quick", action="store_true", help="fewer requests (~6 min instead of ~20)")
    p.add_argument("--skip-litellm", action="store_true")
    p.add_argument("--skip-routers", action="store_true", help="don't measure vllm-router and smg")
    p.add_argument("--skip-variants", action="store_true", help="don't measure feature-off variants")
    p.add_argument("--skip-rss", action="store_true")
    p.add_argument("--litellm-only", metavar="RESULTS_JSON",
                   help="measure only LiteLLM and add it to an earlier run's results (so that the "
                        "full mode fits in two shorter holds of a shared machine)")
    p.add_argument("--out", default=str(RESULTS / "gateway_overhead"), help="output path prefix")
    p.add_argument("--load-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.load_worker:
        load_worker(*a.load_worker)
        return
    mode_name = os.environ.get("GATEWAY_OVERHEAD_MODE") or ("quick" if a.quick else "full")
    mode = MODES[mode_name]
    workdir = Path(tempfile.mkdtemp(prefix="yg-overhead-"))
    results: dict[str, Any] = {"mode": mode_name, "started_at": time.time(), "targets": {}, "variants": {}}
    if a.litellm_only:
        results = json.loads(Path(a.litellm_only).read_text())
        results["targets"].pop("litellm", None)
        results["litellm_separate_run_at"] = time.time()
        mode_name = results["mode"]
        mode = MODES[mode_name]
        LOADAVG.update({k: v for k, v in results.get("loadavg_1min", {}).items() if k != "litellm"})
    up_port = free_port()
    upstream = start_upstream(up_port)
    up_url = f"http://127.0.0.1:{up_port}"
    t0 = time.monotonic()
    try:
        if not a.litellm_only:
            results["targets"]["direct"] = run_target("direct", up_url, None, [], mode, workdir, SWEEP)
            cleanup_redis()
            yg = Yieldgate(up_url, workdir, "full")
            try:
                results["targets"]["yieldgate"] = run_target("yieldgate", yg.url, yg.api_key, yg.pids, mode,
                                                             workdir, SWEEP)
                if not a.skip_rss:
                    results["rss"] = rss_run(yg.url, yg.api_key, yg.pids, mode, workdir)
            finally:
                yg.close()
        if not a.skip_variants and not a.litellm_only:  # before LiteLLM: nothing of it may be left running on core 1
            for variant in VARIANT_ORDER:
                cleanup_redis()
                g = Yieldgate(up_url, workdir, variant)
                try:
                    print(f"== yieldgate[{variant}]", flush=True)
                    phases = [ph for ph in plan(mode, [], streams=False) if ph["name"] in ("warmup", "fixed_500")]
                    rows = run_phases(target(g.url, g.api_key), phases, g.pids, workdir)
                    results["variants"][variant] = {r["name"]: r for r in rows}
                finally:
                    g.close()
            floor = PythonFloor(up_url)  # what the stack costs before any of yieldgate's work
            try:
                print("== python floor", flush=True)
                phases = [ph for ph in plan(mode, [], streams=False) if ph["name"] in ("warmup", "fixed_500")]
                rows = run_phases(target(floor.url, None), phases, floor.pids, workdir)
                results["variants"]["floor"] = {r["name"]: r for r in rows}
            finally:
                floor.close()
        if not a.skip_routers and not a.litellm_only:
            for name in ROUTERS:
                router = RustRouter(name, [up_url, up_url], workdir)
                results.setdefault("versions", {})[name] = router.version
                try:
                    results["targets"][name] = run_target(name, router.url, None, router.pids, mode, workdir, SWEEP)
                finally:
                    router.close()
        if a.litellm_only:
            # The sweep again with this harness (fresh client pool after a pause), so both
            # gateways' max RPS come from the same procedure.
            cleanup_redis()
            yg = Yieldgate(up_url, workdir, "full")
            try:
                print("== yieldgate sweep (again)", flush=True)
                phases = [ph for ph in plan(mode, SWEEP, streams=False) if ph["name"] == "warmup" or ph.get("sweep")]
                rows = run_phases(target(yg.url, yg.api_key), phases, yg.pids, workdir)
                kept = {k: v for k, v in results["targets"]["yieldgate"].items() if not k.startswith("sweep_")}
                results["targets"]["yieldgate"] = kept | {r["name"]: r for r in rows if r["name"] != "warmup"}
                results["yieldgate_sweep_rerun"] = True
            finally:
                yg.close()
        if not a.skip_litellm:
            ll = LiteLLM(up_url, workdir)
            results["litellm_version"] = ll.version
            try:
                results["targets"]["litellm"] = run_target("litellm", ll.url, ll.api_key, ll.pids, mode, workdir,
                                                           SWEEP_SLOW)
            finally:
                ll.close()
    finally:
        stop(upstream)
        cleanup_redis()
    results["runtime_s"] = results.get("runtime_s", 0) + time.monotonic() - t0
    results["loadavg_1min"] = LOADAVG
    results["analysis"] = analyse(results)
    results["meta"] = result_meta(results)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1))
    md = markdown(results)
    out.with_suffix(".md").write_text(md)
    plot(results, out.with_suffix(".png"))
    print(md)
    print(f"runtime {results['runtime_s']:.0f}s; results in {out}.{{json,md,png}}")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
