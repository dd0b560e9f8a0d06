"""A gateway served by uvicorn in a background thread of the calling process.

For benchmarks, notebooks and tests that need a real gateway with their own `Config` next to code
that inspects it (`EmbeddedGateway.gateway` is the running `Gateway`).
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .app import Gateway, create_app
from .config import Config


class EmbeddedGateway:
    def __init__(self, config: Config, start_timeout_s: float = 30.0):
        with socket.socket() as s:  # a free port, unless the config names one
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        self.port = free
        config.server.port = free
        self.app = create_app(config)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", access_log=False))
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
