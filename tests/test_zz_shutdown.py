"""Runs last (file order): SIGTERM to `yieldgate up` stops every engine it started — no orphans."""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from polling import exit_code


def test_sigterm_stops_every_child(stack):
    if stack.process is None:
        pytest.skip("reusing an external stack")
    up = psutil.Process(stack.process.pid)
    children = up.children(recursive=True)
    engines = [c for c in children if "vllm.entrypoints" in " ".join(c.cmdline())]
    assert len(engines) == 2
    assert len(children) >= 4  # each engine forks an EngineCore (and workers)
    up.send_signal(signal.SIGTERM)  # only the parent: it must clean up after itself
    exit_code(stack.process, 120, stack.extra.get("log_path"))
    deadline = time.monotonic() + 30
    alive = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.5)
        alive = [c for c in alive if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"orphans left: {[(c.pid, c.cmdline()[:4]) for c in alive]}"
