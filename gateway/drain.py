"""Stopping a gateway replica without failing requests: SIGTERM drains it.

The first SIGTERM turns readiness false (`/readyz` 503) while the listener keeps accepting for
`server.drain_s`, the time a load balancer takes to notice; then the listener closes and
in-flight requests get `server.stop_timeout_s` to finish. Past that, or on a second SIGTERM,
streams still open are ended with an error event and `[DONE]` (billed for what was relayed) and
unary requests still waiting are cancelled. The app's shutdown then closes the ledger, which
flushes its journal to the store, and the process exits 0. SIGINT (Ctrl-C) skips the
accepting window, and so does a SIGTERM that comes before the listener opened (while the app loads
or starts: `yieldgate gateway` catches it from the start, gateway/cli.py): the gateway then stops as
soon as its start-up is done, exit 0.
"""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import socket
import time
from types import FrameType
from typing import Any, Callable, Coroutine

import uvicorn

log = logging.getLogger("yieldgate.drain")

# How long cut streams get to write their error event before their tasks are cancelled, and how
# long cancelled tasks get to end.
_CUT_GRACE_S = 2.0
# While the stop waits, a log line this often says on what.
_PROGRESS_S = 5.0


def where_tasks_wait(tasks: "set[asyncio.Task] | list[asyncio.Task]", limit: int = 6) -> str:
    """Each task's name and the innermost frames it is suspended in, for a log line that says
    what a stop is waiting on."""
    out = io.StringIO()
    for task in list(tasks)[:limit]:
        out.write(f"\n  task {task.get_name()}:")
        for frame in task.get_stack(limit=4):
            code = frame.f_code
            out.write(f" {code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
    if len(tasks) > limit:
        out.write(f"\n  ... and {len(tasks) - limit} more")
    return out.getvalue()


def default_instance_id() -> str:
    """Unique per process on a host, readable in a ledger row: "<hostname>-<pid>"."""
    return f"{socket.gethostname()}-{os.getpid()}"


async def close_within(name: str, closing: Coroutine[Any, Any, None], warn_s: float = 10.0,
                       limit_s: float = 30.0) -> None:
    """Await one part of the app's shutdown. Still closing after `warn_s`: the log names it and
    where every task waits; after `limit_s` the stop goes on without it. A part that fails is
    logged, and the parts after it still close."""
    task = asyncio.ensure_future(closing)
    done, _ = await asyncio.wait({task}, timeout=warn_s)
    if not done:
        others = asyncio.all_tasks() - {asyncio.current_task()}
        log.warning("stop: %s still closing after %g s:%s", name, warn_s, where_tasks_wait(others, limit=12))
        done, _ = await asyncio.wait({task}, timeout=limit_s - warn_s)
    if not done:
        log.error("stop: %s did not close within %g s; the stop goes on without it", name, limit_s)
        task.cancel()
    elif not task.cancelled() and task.exception() is not None:
        log.error("stop: closing %s failed", name, exc_info=task.exception())


class Drain:
    """The gateway's shutdown state, read by /readyz and the stream relay."""

    def __init__(self) -> None:
        self.draining = False
        self.started_at: float | None = None     # time.monotonic() of the first signal
        self._cutters: set[Callable[[], None]] = set()

    def begin(self) -> None:
        if not self.draining:
            self.draining, self.started_at = True, time.monotonic()

    def track(self, cut: Callable[[], None]) -> Callable[[], None]:
        """Register an open stream's `cut`; returns the function that unregisters it."""
        self._cutters.add(cut)
        return lambda: self._cutters.discard(cut)

    @property
    def open_streams(self) -> int:
        return len(self._cutters)

    def cut_streams(self) -> int:
        """End every open stream now (each writes its error event and is billed)."""
        cutters, self._cutters = list(self._cutters), set()
        for cut in cutters:
            cut()
        return len(cutters)


class DrainingServer(uvicorn.Server):
    """uvicorn's server with the drain above; exits 0 after a drained SIGTERM (uvicorn re-raises
    the captured signal after its shutdown, which would end the process with -SIGTERM)."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_s: float, stop_timeout_s: float):
        super().__init__(config)
        self.drain = drain
        self.drain_s = drain_s
        self.stop_timeout_s = stop_timeout_s
        self.forced = False
        self._accept_until: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or self.should_exit:
            self.forced = True      # a second signal: stop waiting for anything
            self.should_exit = True
            return
        self.drain.begin()
        # Before the listener opens no load balancer has seen the gateway ready: nothing to drain.
        if sig == signal.SIGTERM and self.drain_s > 0 and self.started:
            self._accept_until = time.monotonic() + self.drain_s
            log.warning("SIGTERM: draining (not ready; accepting for %.1f s, then up to %.1f s for "
                        "requests in flight)", self.drain_s, self.stop_timeout_s)
        else:
            self.should_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._accept_until is not None and time.monotonic() >= self._accept_until:
            self.should_exit = True
        return await super().on_tick(counter)

    async def _wait_tasks_to_complete(self) -> None:
        state = self.server_state
        started = time.monotonic()
        deadline, report = started + self.stop_timeout_s, started + _PROGRESS_S
        log.warning("stop: listener closed; %d connections, %d requests in flight",
                    len(state.connections), len(state.tasks))
        while (state.connections or state.tasks) and not self.forced and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
            if time.monotonic() >= report:
                report += _PROGRESS_S
                log.warning("stop: waiting for %d connections, %d requests in flight (%d streams)",
                            len(state.connections), len(state.tasks), self.drain.open_streams)
        if state.tasks:
            cut = self.drain.cut_streams()
            log.warning("stop: %s with %d requests in flight; %d streams ended with an error event",
                        "second signal" if self.forced else f"{self.stop_timeout_s:g} s passed",
                        len(state.tasks), cut)
            end = time.monotonic() + _CUT_GRACE_S
            while state.tasks and time.monotonic() < end:
                await asyncio.sleep(0.05)
            # Unary requests still waiting on an engine: cancelled now, so that they are recorded
            # before the ledger closes in the app's shutdown.
            tasks = list(state.tasks)
            for task in tasks:
                task.cancel()
            if tasks:
                _, stuck = await asyncio.wait(tasks, timeout=_CUT_GRACE_S)
                if stuck:  # never wait on them for ever: the ledger still has to close
                    log.error("stop: %d requests did not end when cancelled:%s", len(stuck),
                              where_tasks_wait(stuck))
        log.warning("stop: requests done after %.1f s; closing the app", time.monotonic() - started)
        for server in self.servers:
            await server.wait_closed()
