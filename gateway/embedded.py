"""A gateway served by uvicorn in a background thread of the calling process, or in a child
process of its own.

`EmbeddedGateway`: for benchmarks, notebooks and tests that need a real gateway with their own
`Config` next to code that inspects it (`EmbeddedGateway.gateway` is the running `Gateway`).
`GatewayProcess`: the same config in its own OS process (`yieldgate gateway` semantics), for
multi-gateway tests and for benchmarks whose load generator must not share a GIL with it.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import uvicorn

from .app import Gateway, create_app, server_config
from .config import Config


class EmbeddedGateway:
    def __init__(self, config: Config, start_timeout_s: float = 30.0):
        with socket.socket() as s:  # a free port, unless the config names one
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        self.port = free
        config.server.port = free
        self.app = create_app(config)
        self.server = uvicorn.Server(server_config(self.app, config, host="127.0.0.1"))
        self.thread = threading.Thread(target=self.server.run, name="embedded-gateway", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("embedded gateway did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    @property
    def gateway(self) -> Gateway:
        return self.app.state.gateway

    def stop(self, timeout_s: float = 15.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)


class GatewayProcess:
    def __init__(self, config: Config, workdir: Path, start_timeout_s: float = 60.0, port: int = 0,
                 wait: bool = True):
        """On config.server.host (a loopback address of its own can stand for a host of its own),
        on `port` or a free one; returns once it serves a tier, or at once with wait=False."""
        import msgspec

        host = config.server.host
        if not port:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        config.server.port = self.port = port
        workdir.mkdir(parents=True, exist_ok=True)
        config_path = workdir / f"gateway-{self.port}.json"
        config_path.write_bytes(msgspec.json.encode(config))
        self.log_path = workdir / f"gateway-{self.port}.log"
        code = ("import sys, msgspec; from yieldgate.gateway.config import Config; from yieldgate.gateway.cli import _serve; "
                "_serve(msgspec.json.decode(open(sys.argv[1], 'rb').read(), type=Config))")
        root = Path(__file__).resolve().parent.parent
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen([sys.executable, "-c", code, str(config_path)], cwd=root,
                                            stdout=log, stderr=subprocess.STDOUT)
        self.url = f"http://{host}:{self.port}"
        deadline = time.monotonic() + start_timeout_s
        while wait and not serves_a_tier(self.url):
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"gateway process did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Ctrl-C semantics (SIGINT): requests in flight finish, without SIGTERM's accepting window."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def serves_a_tier(url: str, timeout: float = 2.0) -> bool:
    """True once the gateway at `url` answers /healthz with at least one tier able to serve."""
    try:
        with urllib.request.urlopen(url + "/healthz", timeout=timeout) as resp:
            return resp.status == 200 and json.loads(resp.read()).get("status") in ("ok", "degraded")
    except (OSError, ValueError):
        return False


def http_status(url: str, timeout: float = 2.0) -> int:
    """GET `url` and return its status; 0 when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def stop_process_group(proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    """SIGTERM a child started with `start_new_session=True` (e.g. `yieldgate up` and its engines),
    SIGKILL its group if it has not exited after `timeout_s`."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
