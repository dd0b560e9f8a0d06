"""A watch on the gateway's event loop: when one callback holds it (sync work, a blocking call),
no request, signal or timer moves meanwhile. A thread pings the loop; a ping answered late is
logged with the loop thread's stack at that moment: what held the loop."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
import traceback

log = logging.getLogger("yieldgate.stall")


class LoopWatch:
    """Made on the loop's own thread (the gateway's start-up)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, stalled_s: float = 1.0, interval_s: float = 0.25):
        self.loop, self.stalled_s, self.interval_s = loop, stalled_s, interval_s
        self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="yieldgate-loop-watch", daemon=True)
        self._loop_thread = threading.get_ident()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            answered = threading.Event()
            sent = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(answered.set)
            except RuntimeError:  # the loop is closed
                return
            if answered.wait(self.stalled_s):
                continue
            stack = sys._current_frames().get(self._loop_thread)
            where = "".join(traceback.format_stack(stack, limit=12)) if stack is not None else "?"
            while not answered.wait(self.interval_s) and not self._stop.is_set():
                pass
            held = time.monotonic() - sent
            self.longest_s = max(self.longest_s, held)
            log.warning("event loop held for %.1f s; %.1f s in, its thread was in:\n%s", held,
                        self.stalled_s, where)
