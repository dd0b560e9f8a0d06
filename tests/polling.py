"""Waiting in tests for something another process or thread brings about, bounded in count."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable


def until(predicate: Callable[[], Any], what: str, attempts: int = 600, pause_s: float = 0.1) -> Any:
    """Poll `predicate` until it is truthy (at most `attempts` times); returns its value."""
    for _ in range(attempts):
        value = predicate()
        if value:
            return value
        time.sleep(pause_s)
    raise AssertionError(f"never happened: {what}")


def exit_code(process: subprocess.Popen, timeout_s: float, log_path: Path | None = None) -> int:
    """`process`'s exit code once it ends within `timeout_s`. A yieldgate gateway that does not end
    is asked for every thread's stack (SIGUSR1: faulthandler in `yieldgate gateway`), and the failure
    carries the tail of its log: what it was waiting on."""
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGUSR1)
        time.sleep(1.0)
        tail = log_path.read_text(errors="replace")[-6000:] if log_path is not None else ""
        raise AssertionError(f"pid {process.pid} still running after {timeout_s:g} s; its log ends:\n{tail}") from None
