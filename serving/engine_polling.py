"""`vllm.general_plugins` entry point: how a launched engine's processes wait for each other.

vLLM's engine core and its worker pass every step through a shared-memory ring buffer, and a
reader that has read in the last second polls it in a loop of `sched_yield()` calls. On a GPU
host that loop holds one spare core. On a CPU host that also runs the gateway (`yieldgate up`, the
test suite, a small node) it holds the core the worker is not computing on, and Linux's scheduler
keeps other runnable processes waiting behind a yielding loop: measured here, a gateway relaying
three streams from the demo engine waited 12.5 s in the run queue (no /readyz answer, no accept)
until the streams ended. With a pause of a few tens of microseconds between polls instead, it
answered every probe within milliseconds.

The launcher sets YIELDGATE_ENGINE_POLL_PAUSE_US for the engines it starts (`[fleet.replicas.launch]
poll_pause_us`, 0 = vLLM's own loop); an engine started by other means takes the same variable.
"""

from __future__ import annotations

import os
import time

ENV = "YIELDGATE_ENGINE_POLL_PAUSE_US"


def register() -> None:
    """Replace the ring buffer's `sched_yield()` with a short sleep when ENV asks for one
    (idempotent: vLLM loads general plugins in every process, possibly more than once)."""
    pause_us = float(os.environ.get(ENV, "0") or 0)
    if pause_us <= 0:
        return
    from vllm.distributed import utils
    from vllm.distributed.device_communicators import shm_broadcast

    pause_s = pause_us / 1e6

    def pause() -> None:
        time.sleep(pause_s)

    pause.__qualname__ = f"yieldgate_pause_{pause_us:g}us"
    utils.sched_yield = pause
    shm_broadcast.sched_yield = pause
