"""Rigs the engine and weight benchmarks share (rollout.py, adapter_push.py, engine_crash.py,
engine_hops.py, lora_engine.py, engine_polling.py): a private demo stack, one demo engine launched
as `yieldgate up` launches it, its decode rate, the demo models, perturbed weights, and the load
process of rollout_load.py with its records. Scripts import these from here, never from each other."""

from __future__ import annotations

import json
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from yieldgate.gateway.embedded import stop_process_group
from yieldgate.serving.demo_model import DemoModelSpec, ensure_demo_model

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def own_stack(port: int, model_dir: Path):
    """`yieldgate up` on a private home and ports (gateway `port`, engines port+101, +102)."""
    home = Path(tempfile.mkdtemp(prefix="yg-rollout-"))
    token = "bench-admin-" + secrets.token_hex(8)
    config = home / "yieldgate.toml"
    config.write_text(f"""
[server]
host = "127.0.0.1"
port = {port}
admin_token = "{token}"
redis_url = "redis://127.0.0.1:6379/{os.environ.get('YIELDGATE_TEST_REDIS_DB', '15')}"

[fleet]
model = "demo"
block_size = 32
demo_base_port = {port + 101}
""")
    env = dict(os.environ, YIELDGATE_HOME=str(home), PYTHONUNBUFFERED="1",
               YIELDGATE_FLEET__MODEL_PATH=str(model_dir))
    log = open(home / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "yieldgate.gateway.cli", "up", "--config", str(config)],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"yieldgate up exited:\n{(home / 'up.log').read_text()[-3000:]}")
            try:
                if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("stack not healthy after 900 s")
            time.sleep(2)
        yield url, token
    finally:
        stop_process_group(proc)
        log.close()


def model_dir(big: bool) -> Path:
    if not big:
        return ensure_demo_model()
    return ensure_demo_model(spec=DemoModelSpec(hidden_size=384, intermediate_size=1024, num_layers=4,
                                                num_heads=6, num_kv_heads=2))


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


@contextmanager
def load_process(gateway: str, concurrency: int, out: Path, model: str = "demo", chunk_s: float = 10.0):
    """benchmarks/rollout_load.py in its own process, on `model` (the base model or an adapter),
    from here until the block ends (then it finishes its current load slice, at most `chunk_s`,
    and exits); its records are in `out` afterwards."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("rollout_load.py")),
                             "--gateway", gateway, "--out", str(out), "--concurrency", str(concurrency),
                             "--model", model, "--chunk-s", str(chunk_s)],
                            cwd=ROOT, env=env, stdin=subprocess.PIPE)
    try:
        yield proc
    finally:
        proc.stdin.close()  # "stop"
        try:
            proc.wait(200)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_for_traffic(path: Path, timeout_s: float = 120.0) -> None:
    """Until the load process has answers from both the load and the probes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            load, probes = read_records(path)
            if load and probes:
                return
        time.sleep(0.5)
    raise SystemExit(f"the load process recorded no traffic in {timeout_s:.0f} s ({path})")


def read_records(path: Path) -> tuple[list[dict], list[dict]]:
    """-> (load records, probe records) written by the load process."""
    # A line still being written when read mid-run is skipped (it has no newline yet).
    rows = [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]
    return [r for r in rows if r["kind"] == "load"], [r for r in rows if r["kind"] == "probe"]


def spread(values: list[float]) -> dict:
    """Median and interquartile range (quartiles by the inclusive method)."""
    if len(values) < 2:
        v = values[0] if values else None
        return {"median": v, "q1": v, "q3": v, "iqr": 0.0 if values else None, "n": len(values)}
    q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"median": med, "q1": q1, "q3": q3, "iqr": q3 - q1, "n": len(values)}


def decode_rate(url: str, model: str, concurrency: int, requests: int = 8) -> float:
    """Output tokens per second per request (mean over requests), greedy, 128 tokens each."""
    def one(i: int) -> float:
        t = time.perf_counter()
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": f"Request {i}: once upon a time", "max_tokens": 128,
            "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return r.json()["usage"]["completion_tokens"] / (time.perf_counter() - t)

    one(-1)  # warm-up
    with ThreadPoolExecutor(concurrency) as pool:
        return statistics.mean(pool.map(one, range(requests)))


@contextmanager
def demo_engine(port: int, lora: bool, log_path: Path, poll_pause_us: float | None = None,
                model_dir: Path | None = None) -> Iterator[str]:
    """The demo fleet's standard-0 engine as `yieldgate up` launches it (LoRA on or off; its ring-buffer
    poll pause, serving/engine_polling.py, as configured unless given) on `port`, healthy; its URL.
    `model_dir`: the model it serves (default: the generated tiny model). Stopped (its whole process
    group) on the way out."""
    import msgspec

    from yieldgate.serving.config import FleetConfig, LoraConfig
    from yieldgate.serving.demo_model import ensure_demo_model
    from yieldgate.serving.launcher import answers_health, engine_command, engine_env

    fleet = FleetConfig(demo_base_port=port)
    replica = fleet.replicas[0]  # standard-0
    if poll_pause_us is not None:
        replica = msgspec.structs.replace(
            replica, launch=msgspec.structs.replace(replica.launch, poll_pause_us=poll_pause_us))
    spec = LoraConfig(enabled=lora)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(engine_command(str(model_dir or ensure_demo_model()), "demo", fleet.block_size,
                                               replica, spec),
                                env=engine_env(replica, spec), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        while not answers_health(replica.base_url, 1.0):
            if proc.poll() is not None:
                raise SystemExit(f"engine exited {proc.returncode}: {log_path.read_text()[-2000:]}")
            time.sleep(0.25)
        yield replica.base_url
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
