"""Several gateway processes on one port: `server.workers = N`.

The parent starts N worker processes (spawned: fresh interpreters, nothing forked from a parent
that may run engine supervision threads); each binds the port with SO_REUSEPORT, so the kernel
spreads connections over their listeners, and runs a whole gateway, sharing keys, budgets, rate
limits, the prefix index and the ledger through Redis/PostgreSQL as separate gateways do. Engines
(`yieldgate up`) are launched and supervised once, by the parent. Prometheus runs in multiprocess
mode over a directory the parent owns (gateway/metrics.py), so any worker's /metrics counts them all.

SIGTERM (or SIGINT) to the parent is passed to every worker, each drains as one gateway does
(gateway/drain.py), and the parent returns once all have exited; a second signal is passed on too
(stop waiting). Workers live in a process group of their own (a terminal's Ctrl-C reaches only the
parent, which passes it on once) and die with the parent (PR_SET_PDEATHSIG). A worker that exits
on its own while the gateway runs is started again; one that fails during start-up stops them all.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path
from typing import Callable

import msgspec

from .config import Config

log = logging.getLogger("yieldgate.workers")

_PR_SET_PDEATHSIG = 1
# A worker that exits sooner than this after its start failed to start: the gateway stops.
_STARTUP_S = 30.0


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A socket bound to host:port that other processes may bind too (SO_REUSEPORT). Not listening
    yet: the kernel hands connections only to listening sockets, and uvicorn listens once the app
    has started, so a worker still starting gets no connection to keep waiting."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    return sock


class PortInUse(OSError):
    """Something already listens on the gateway's port."""


def check_port_free(host: str, port: int) -> None:
    """PortInUse if anything listens on host:port. SO_REUSEPORT would otherwise let the workers
    bind beside a stale gateway of the same user, and the kernel would share the traffic with it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise PortInUse(f"{host}:{port} is in use: {exc.strerror}") from None


def worker_config(config: Config, index: int) -> Config:
    """Worker `index`'s config: its own instance id (ledger rows, headers, metrics) and its own
    ledger journal (a journal belongs to one process)."""
    config = msgspec.structs.replace(config, server=msgspec.structs.replace(config.server))
    if config.server.instance_id:
        config.server.instance_id = f"{config.server.instance_id}-w{index}"
    if index:
        from .accounting import data_dir

        ledger = config.pricing.ledger
        config.pricing = msgspec.structs.replace(config.pricing, ledger=msgspec.structs.replace(
            ledger, journal_dir=str(data_dir(config) / f"journal-w{index}")))
    return config


def enter_worker() -> None:
    """In a worker, first thing: a process group of its own, and death with the parent."""
    os.setpgid(0, 0)
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


class Workers:
    """The parent of `config.server.workers` gateway processes, each running `target(config, index)`
    (a module-level function: it is imported by name in the spawned process)."""

    def __init__(self, config: Config, target: Callable[[Config, int], None]) -> None:
        self.config = config
        self.target = target
        self.count = config.server.workers
        self.context = multiprocessing.get_context("spawn")
        self.processes: dict[int, multiprocessing.process.BaseProcess] = {}
        self.started_at: dict[int, float] = {}
        self.signals: list[int] = []
        self.metrics_dir = Path(tempfile.mkdtemp(prefix="yieldgate-metrics-"))

    def spawn(self, index: int) -> None:
        process = self.context.Process(target=self.target, args=(self.config, index),
                                       name=f"yieldgate-worker-{index}", daemon=False)
        process.start()
        self.processes[index], self.started_at[index] = process, time.monotonic()
        log.warning("worker %d: pid %s", index, process.pid)

    def _on_signal(self, sig: int, frame: object) -> None:
        self.signals.append(sig)
        for process in self.processes.values():
            if process.is_alive():
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def run(self) -> int:
        """Start the workers and keep them running until a signal stops them; 0 if every worker
        exited cleanly after it, else the first failing exit code."""
        from prometheus_client import multiprocess

        # Read by prometheus_client when a worker imports it (it is set before any spawns).
        previous_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir)
        handlers = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        code = 0
        try:
            check_port_free(self.config.server.host, self.config.server.port)
            for index in range(self.count):
                self.spawn(index)
            while self.processes:
                time.sleep(0.1)
                for index, process in list(self.processes.items()):
                    if process.is_alive():
                        continue
                    process.join()
                    multiprocess.mark_process_dead(process.pid, str(self.metrics_dir))
                    del self.processes[index]
                    exit_code = process.exitcode or 0
                    if self.signals:
                        code = code or exit_code
                        continue
                    if time.monotonic() - self.started_at[index] < _STARTUP_S and exit_code:
                        log.error("worker %d exited with %s during start-up: stopping the gateway", index, exit_code)
                        code = exit_code
                        self._on_signal(signal.SIGTERM, None)
                        continue
                    log.error("worker %d (pid %s) exited with %s: starting it again", index, process.pid, exit_code)
                    self.spawn(index)
        finally:
            for sig, handler in handlers.items():
                signal.signal(sig, handler)
            for process in self.processes.values():  # only after an exception in this loop
                process.kill()
            if previous_dir is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = previous_dir
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return code
