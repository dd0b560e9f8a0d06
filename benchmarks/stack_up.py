"""`yieldgate up --config FILE` for a benchmark run, in a home of its own, until its gateway is
ready; stopped afterwards. run_all.py starts the stack a benchmark's README row names with it;
routing.py and adapter_routing.py (--up) too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextmanager
def stack(config: str) -> Iterator[Path]:
    """`yieldgate up --config` in a home of its own until its gateway is ready; stopped afterwards."""
    home = Path(tempfile.mkdtemp(prefix="yieldgate-bench-home-"))
    server = tomllib.loads((ROOT / config).read_text()).get("server", {}) if config else {}
    ready = f"http://{server.get('host', '127.0.0.1')}:{server.get('port', 8000)}/readyz"
    if http_ok(ready):
        # Another stack on these ports would pass the readiness check below, and the benchmark
        # would measure its engines (another model, other KV limits) under this config's name.
        raise SystemExit(f"something already answers at {ready}: stop it before running {config}")
    env = dict(os.environ, YIELDGATE_HOME=str(home))
    proc = subprocess.Popen([PY, "-m", "yieldgate.gateway.cli", "up", *(["--config", str(ROOT / config)] if config else [])],
                            cwd=ROOT, env=env, stdout=open(home / "up.log", "wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        started = time.monotonic()
        while not http_ok(ready):
            if proc.poll() is not None or time.monotonic() - started > 900:
                raise SystemExit(f"stack {config} did not get ready; see {home / 'up.log'}")
            print(f"  … waiting for {config} ({time.monotonic() - started:.0f} s)", flush=True)
            time.sleep(10)
        yield home
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
