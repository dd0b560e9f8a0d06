"""The load tester's own plumbing, against benchmarks/fake_upstream.py (no engine needed)."""

from __future__ import annotations

from conftest import fake_upstream_process
from yieldgate.loadtest import Bounds, ConcurrencyLoad, RandomLengthWorkload, Target, run_compare, run_load


def test_a_closed_loop_longer_than_the_drain_window_loses_no_request():
    # 8 tokens 10 ms apart: >= 80 ms per request, 2 at a time, 100 requests: >= 4 s, while the
    # drain window (drain_timeout_s + timeout_s) is 2.5 s. The window once ran from the phase's
    # start for a closed loop, so the last requests of any longer run were cancelled. A 2 s
    # per-request timeout is 25x a request's time: a busy machine does not fail it.
    bounds = Bounds(requests=100, timeout_s=2.0, drain_timeout_s=0.5)
    with fake_upstream_process("--itl-ms", "10", "--tokens", "8") as url:
        target = Target(base_url=url, stream=False)
        result = run_load(target, RandomLengthWorkload(input_tokens=16, output_tokens=8),
                          ConcurrencyLoad(concurrency=2), bounds)
    summary = result.summary
    assert summary.failed == 0, summary.errors
    assert summary.completed == summary.requests == 100
    # The run outlasted the window: by the records, requests were sent after it would have closed,
    # and each of those completed.
    late = [r for r in result.records if r.start_s > bounds.timeout_s + bounds.drain_timeout_s]
    assert late and all(r.ok for r in late), (len(late), [r.error for r in late if not r.ok][:5])


def test_interleaved_rounds_alternate_which_target_goes_first():
    # A position in the round can carry a bias of its own (what the engine did just before), so
    # an interleaved comparison runs A B, then B A, and so on.
    turns: list[tuple[str, int]] = []
    with fake_upstream_process("--itl-ms", "0", "--tokens", "2") as url:
        a, b = Target(base_url=url, stream=False, name="a"), Target(base_url=url, stream=False, name="b")
        ra, rb = run_compare([a, b], RandomLengthWorkload(input_tokens=8, output_tokens=2),
                             ConcurrencyLoad(concurrency=1), Bounds(requests=8), order="interleaved", rounds=4,
                             on_phase=lambda label, phase, _n: turns.append((label, phase)))
    assert turns == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert ra.summary.completed == rb.summary.completed == 8
