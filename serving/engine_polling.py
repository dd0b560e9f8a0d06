"""`vllm.general_plugins` entry point: how a launched engine's processes wait for each other.

vLLM's engine core and its worker pass every step through a shared-memory ring buffer, and a
reader that has read in the last second polls it in a loop of `sched_yield()` calls. On a GPU
host that loop holds one spare core. On a CPU host that also runs the gateway (`yieldgate up`, the
test suite, a small node) it holds the core the worker is not computing on, and Linux's scheduler
keeps other runnable processes waiting behind a yielding loop: measured here, a gateway relaying
three streams from the demo engine waited 12.5 s in the run queue (no /readyz answer, no accept)
until the streams ended.

With YIELDGATE_ENGINE_POLL_PAUSE_US set, a poll loop yields as before for its first
YIELDGATE_ENGINE_POLL_SPIN_US (a step's answer usually comes sooner), then sleeps that many
microseconds between polls (with a 1 µs timer slack, so a sleep is not rounded up to 50 µs). The
launcher sets both for the engines it starts (`[fleet.replicas.launch] poll_pause_us`,
`poll_spin_us`; pause 0 = vLLM's own loop); an engine started by other means takes the same
variables.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time

ENV = "YIELDGATE_ENGINE_POLL_PAUSE_US"
SPIN_ENV = "YIELDGATE_ENGINE_POLL_SPIN_US"
# Calls further apart than this belong to different poll loops.
_NEW_LOOP_S = 1e-3
_PR_SET_TIMERSLACK = 29


def poller(pause_s: float, spin_s: float, clock=time.monotonic, sleep=time.sleep, yield_=os.sched_yield):
    """A replacement for vLLM's `sched_yield()` in its ring-buffer loops: yield for the first
    `spin_s` of a loop, then sleep `pause_s` a call."""
    state = {"last": 0.0, "start": 0.0}

    def pause() -> None:
        now = clock()
        if now - state["last"] > _NEW_LOOP_S:
            state["start"] = now
        state["last"] = now
        if now - state["start"] < spin_s:
            yield_()
        else:
            sleep(pause_s)
            state["last"] = clock()

    return pause


def register() -> None:
    """Install the poller when ENV asks for one (idempotent: vLLM loads general plugins in every
    process, possibly more than once)."""
    pause_us = float(os.environ.get(ENV, "0") or 0)
    if pause_us <= 0:
        return
    spin_us = float(os.environ.get(SPIN_ENV, "0") or 0)
    try:
        from vllm.distributed import utils
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError as exc:  # another vLLM layout: its own loop, and the engine still starts
        logging.getLogger("yieldgate.engine_polling").warning("poll pause not installed: %s", exc)
        return

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)
    except OSError:
        pass
    pause = poller(pause_us / 1e6, spin_us / 1e6)
    utils.sched_yield = pause
    shm_broadcast.sched_yield = pause
