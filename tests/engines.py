"""A vLLM engine a test module starts for itself (the session stack's engines come from conftest)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest


def start_engine(model_dir: Path, port: int, log_path: Path, *args: str,
                 plugin: bool = True, served_name: str = "demo", host: str = "127.0.0.1",
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """`vllm serve` of the demo model on the CPU backend with the `yieldgate` weight-transfer plugin
    (`plugin=False`: with no weight-transfer backend, like an engine someone else launched).

    Eager mode unless the engine speculates: it starts ~12 s sooner (~50 s sooner on a machine
    without vLLM's compile cache) and decodes the demo model no slower on CPU; vLLM 0.32's CPU
    worker dies on the first speculative step in eager mode, so speculating engines compile."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1", PYTHONHASHSEED="0",
               VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_HOST_IP="127.0.0.1", **(env or {}))
    eager = () if "--speculative-config" in args else ("--enforce-eager",)
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", host, "--port", str(port),
        "--gpu-memory-utilization", "0.3", "--block-size", "32",
        *(("--weight-transfer-config", '{"backend":"yieldgate"}') if plugin else ()), *eager, *args,
    ]
    return subprocess.Popen(cmd, env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, log_path: Path | None, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log_path.read_text()[-3000:] if log_path is not None else ""
            pytest.fail(f"engine exited {proc.returncode}:\n{tail}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    pytest.fail(f"engine at {url} not healthy after {timeout_s}s")


def stop_engine(proc: subprocess.Popen) -> None:
    """SIGTERM the engine's process group; SIGKILL if it has not gone within a minute."""
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def running_engine(model_dir: Path, port: int, log_path: Path, *args: str, host: str = "127.0.0.1",
                   reuse_env: str | None = None, timeout_s: float = 900, **kwargs) -> Iterator[str]:
    """start_engine(...) until healthy; yields its URL and stops it afterwards. The URL in the
    environment variable `reuse_env`, if set, instead (an engine started with the same flags: dev loop)."""
    reuse = os.environ.get(reuse_env) if reuse_env else None
    if reuse:
        yield reuse.rstrip("/")
        return
    proc = start_engine(model_dir, port, log_path, *args, host=host, **kwargs)
    url = f"http://{host}:{port}"
    try:
        wait_healthy(url, proc, log_path, timeout_s=timeout_s)
        yield url
    finally:
        stop_engine(proc)
