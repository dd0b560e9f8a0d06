"""The rig of the proxy-overhead benchmarks (gateway_overhead.py, picker_overhead.py,
gateway_overhead_ab.py, and routing.py's Rust-router peers): ports, processes and their CPU, the fake
upstream, the targets (yieldgate, the pinned Rust routers, LiteLLM, the Python floor), the load
worker (its own process: `python benchmarks/proxy_rig.py --load-worker SPEC OUT`) and the phase plan.
Scripts import these from here, never from each other."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
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
    def __init__(self, upstream: str, workdir: Path, variant: str, code: Path = ROOT,
                 overrides: dict[str, str] | None = None, cores: str = GATEWAY_CORE, label: str = ""):
        """`code`: the checkout whose gateway runs (another worktree, to compare code versions);
        `overrides`: YIELDGATE_* settings on top of the variant's (e.g. YIELDGATE_SERVER__WORKERS);
        `cores`: the CPUs it may run on."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        v = VARIANTS[variant]
        self.workdir = workdir / f"yg-{label or variant}"
        shutil.rmtree(self.workdir, ignore_errors=True)
        self.workdir.mkdir(parents=True)
        cfg = self.workdir / "gateway.toml"
        cfg.write_text(gateway_config(self.port, upstream, self.workdir, **v))
        env = {k: val for k, val in os.environ.items() if not k.startswith("YIELDGATE_")}
        env["YIELDGATE_HOME"] = str(self.workdir)
        env.update(overrides or {})
        # Another checkout runs with its own venv's python: an editable install maps `yieldgate` to
        # one checkout, whatever the working directory.
        python = code / ".venv" / "bin" / "python" if code != ROOT and (code / ".venv").is_dir() else Path(PY)
        self.proc = subprocess.Popen(["taskset", "-c", cores, str(python), "-m", "yieldgate.gateway.cli", "gateway", "--config", str(cfg)],
                                     cwd=code, env=env, stdout=subprocess.DEVNULL,
                                     stderr=open(self.workdir / "gateway.log", "wb"))
        self._wait_up(self.url + "/healthz", 180)  # a loaded host starts it slowly
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


SWEEP_SETTLE_S = 10.0  # pause before a rate sweep, so the previous phase's backlog drains


if __name__ == "__main__":
    if sys.argv[1:2] != ["--load-worker"] or len(sys.argv) != 4:
        raise SystemExit("usage: python benchmarks/proxy_rig.py --load-worker SPEC OUT")
    load_worker(sys.argv[2], sys.argv[3])
