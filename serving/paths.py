"""Where yieldgate keeps its files on a host: one place for every package that needs it."""

from __future__ import annotations

import os
from pathlib import Path


def home_dir() -> Path:
    """Where yieldgate keeps generated models, engine logs, checkpoints and the ledger ($YIELDGATE_HOME)."""
    return Path(os.environ.get("YIELDGATE_HOME") or Path.home() / ".cache" / "yieldgate")
