"""The event-loop watch names what held the loop."""

from __future__ import annotations

import asyncio
import logging
import time

from yieldgate.gateway.stall import LoopWatch


def hold_the_loop(seconds: float) -> None:
    time.sleep(seconds)  # sync work on the loop: nothing else moves meanwhile


async def _run(caplog) -> LoopWatch:
    watch = LoopWatch(asyncio.get_running_loop(), stalled_s=1.0, interval_s=0.05)
    watch.start()
    await asyncio.sleep(0.2)  # a loop that turns is not reported
    assert watch.longest_s == 0.0
    hold_the_loop(2.0)
    await asyncio.sleep(0.3)
    watch.stop()
    return watch


def test_a_held_loop_is_logged_with_what_held_it(caplog):
    with caplog.at_level(logging.WARNING, logger="yieldgate.stall"):
        watch = asyncio.run(_run(caplog))
    assert 1.5 <= watch.longest_s
    # Held 2 s against a 1 s threshold: a loaded machine's own stalls stay under it.
    (record,) = [r for r in caplog.records if r.name == "yieldgate.stall"]
    assert "event loop held for" in record.getMessage() and "hold_the_loop" in record.getMessage()
