"""Keep the engines `yieldgate up` launched running: restart one that exits or stops answering
health, with backoff, a bounded number of times per window; then leave it down and say why.

A restart first kills the engine's whole process group (the API server's EngineCore outlives a
killed server) and waits until none of it is left, so no orphan holds memory or the port. The
gateway sees the engine come back through its own health probes and restores its weights before
admitting it (trainer_bridge/engine_restore.py `EngineRestore`).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Literal

from .config import SupervisionConfig
from .launcher import EngineProcess, Launcher, answers_health, tail

log = logging.getLogger("yieldgate.supervisor")

State = Literal["running", "starting", "backoff", "failed"]
# (replica, event, detail): event is "exited", "unhealthy", "restarted", "up" or "gave_up".
EventSink = Callable[[str, str, str], None]


@dataclass
class Watched:
    """One launched engine as the supervisor sees it."""

    engine: EngineProcess
    state: State = "running"
    since: float = field(default_factory=time.monotonic)   # when the state began
    restarts: list[float] = field(default_factory=list)    # monotonic times, within the window
    total_restarts: int = 0
    unhealthy_since: float | None = None
    reason: str = ""                                        # why it last went down
    next_start_at: float = 0.0

    def describe(self) -> dict[str, object]:
        return {"state": self.state, "pid": self.engine.process.pid, "restarts": self.total_restarts,
                "restarts_in_window": len(self.restarts), "reason": self.reason,
                "for_s": round(time.monotonic() - self.since, 1), "log": str(self.engine.log_path)}


class Supervisor:
    """A thread that checks every launched engine each second (health every `interval_s`)."""

    def __init__(self, launcher: Launcher, config: SupervisionConfig, health_timeout_s: float = 5.0,
                 on_event: EventSink | None = None, interval_s: float = 2.0) -> None:
        self.launcher = launcher
        self.config = config
        self.health_timeout_s = health_timeout_s
        self.on_event = on_event
        self.interval_s = interval_s
        self.watched = {e.replica.name: Watched(e) for e in launcher.engines}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if not self.config.enabled or self._thread is not None:
            return
        # Engines started from this thread get PR_SET_PDEATHSIG tied to it: they are signalled
        # when it ends, which happens only at stop(), just before the launcher stops them anyway.
        self._thread = threading.Thread(target=self._run, name="yieldgate-supervisor", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    def status(self) -> dict[str, dict[str, object]]:
        with self._lock:
            return {name: w.describe() for name, w in self.watched.items()}

    def _run(self) -> None:
        last_health = 0.0
        while not self._stop.wait(1.0):
            now = time.monotonic()
            probe = now - last_health >= self.interval_s
            if probe:
                last_health = now
            for name, watched in self.watched.items():
                try:
                    self.check(watched, now, probe)
                except Exception:  # noqa: BLE001 - one engine's trouble must not stop the others' watch
                    log.exception("supervisor: checking %s failed", name)

    def check(self, w: Watched, now: float, probe: bool = True) -> None:
        """One step for one engine; public so tests can drive it without the thread."""
        engine = w.engine
        if w.state == "failed":
            return
        if w.state == "backoff":
            if now >= w.next_start_at and not self._stop.is_set():
                self._respawn(w, now)
            return
        code = engine.process.poll()
        if code is not None:
            self._down(w, now, "exited", f"engine exited with code {code}")
            return
        if not probe:
            return
        healthy = answers_health(engine.url, self.health_timeout_s)
        if w.state == "starting":
            if healthy:
                self._set(w, "running", now)
                w.unhealthy_since = None
                self._emit(engine.replica.name, "up", f"healthy {now - w.since:.0f} s after its start")
            elif now - w.since > engine.replica.launch.startup_timeout_s:
                self._down(w, now, "unhealthy", f"not healthy {engine.replica.launch.startup_timeout_s:.0f} s after start")
            return
        if healthy:
            w.unhealthy_since = None
            return
        if w.unhealthy_since is None:
            w.unhealthy_since = now
        elif now - w.unhealthy_since >= self.config.unhealthy_after_s:
            self._down(w, now, "unhealthy", f"no health answer for {now - w.unhealthy_since:.0f} s")

    def _down(self, w: Watched, now: float, event: str, reason: str) -> None:
        name = w.engine.replica.name
        if not w.engine.kill_group():
            reason += "; a process of its group outlived SIGKILL"
        w.restarts = [t for t in w.restarts if now - t < self.config.window_s]
        w.reason = reason
        self._emit(name, event, reason)
        if len(w.restarts) >= self.config.max_restarts:
            self._set(w, "failed", now)
            w.reason = (f"{reason}; not restarted: {len(w.restarts)} restarts in the last "
                        f"{self.config.window_s:.0f} s (max_restarts {self.config.max_restarts})")
            log.error("engine %s stays down: %s\nlast log lines:\n%s", name, w.reason, _tail(w))
            self._emit(name, "gave_up", w.reason)
            return
        delay = min(self.config.backoff_initial_s * 2 ** len(w.restarts), self.config.backoff_max_s)
        w.next_start_at = now + delay
        self._set(w, "backoff", now)
        log.warning("engine %s down (%s); restarting in %.0f s", name, reason, delay)

    def _respawn(self, w: Watched, now: float) -> None:
        replica = w.engine.replica
        fresh = self.launcher.spawn(replica)
        engines = self.launcher.engines
        engines[engines.index(w.engine)] = fresh
        w.engine = fresh
        w.restarts.append(now)
        w.total_restarts += 1
        w.unhealthy_since = None
        self._set(w, "starting", now)
        self._emit(replica.name, "restarted", f"pid {fresh.process.pid} (restart {w.total_restarts})")
        log.warning("engine %s restarted: pid %d", replica.name, fresh.process.pid)

    def _set(self, w: Watched, state: State, now: float) -> None:
        with self._lock:
            w.state, w.since = state, now

    def _emit(self, replica: str, event: str, detail: str) -> None:
        if self.on_event is not None:
            try:
                self.on_event(replica, event, detail)
            except Exception:  # noqa: BLE001 - a listener's bug must not stop supervision
                log.exception("supervisor event listener failed")


def _tail(w: Watched) -> str:
    return tail(w.engine.log_path, 20)
