"""The load tester's own plumbing, against benchmarks/fake_upstream.py (no engine needed)."""

from __future__ import annotations

from conftest import fake_upstream_process
from yieldgate.loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, Target, run_load


def test_a_closed_loop_longer_than_the_drain_window_loses_no_request():
    # 8 tokens 10 ms apart: ~80 ms per request, 2 at a time, 60 requests: ~2.4 s, while the
    # drain window (drain_timeout_s + timeout_s) is 1.5 s. The window once ran from the phase's
    # start for a closed loop, so the last requests of any longer run were cancelled.
    with fake_upstream_process("--itl-ms", "10", "--tokens", "8") as url:
        target = Target(base_url=url, stream=False)
        result = run_load(target, RandomLengthWorkload(input_tokens=16, output_tokens=8),
                          ConcurrencyLoad(concurrency=2), Bounds(requests=60, timeout_s=1.0, drain_timeout_s=0.5))
    summary = result.summary
    assert summary.failed == 0, summary.errors
    assert summary.completed == summary.requests == 60
    assert summary.duration_s > 1.5  # the run did outlast the window
