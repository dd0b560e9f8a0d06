"""What each replica served, when, and how it ended: the record rollback chooses from.

A rollback returns each replica to the version it served before the current one, skipping any
version that was itself rolled back or whose rollout failed (marked here). The record is a JSON
file beside the checkpoints (`CheckpointStore.history`), so a restarted gateway answers the same.
Versions are the engines' names ("default" = the launch weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Literal

import msgspec

Ending = Literal["", "superseded", "rolled_back", "failed", "replaced"]


class Stint(msgspec.Struct):
    """One replica serving one version, from `started_at` until `ended_at` (None: still does)."""

    replica: str
    version: str
    started_at: float
    ended_at: float | None = None
    ended: Ending = ""      # replaced: the engine was found serving something else (e.g. restarted)
    reason: str = ""


class Mark(msgspec.Struct):
    """A version no rollback may return to (an explicit one still can, and clears it)."""

    mark: Literal["rolled_back", "failed"]
    at: float
    reason: str = ""


class _Record(msgspec.Struct):
    stints: list[Stint] = []
    marks: dict[str, Mark] = {}


class WeightHistory:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._rec = msgspec.json.decode(self.path.read_bytes(), type=_Record) \
            if self.path.exists() else _Record()

    # -- reading
    def serving(self, replica: str) -> str | None:
        stint = self._open(replica)
        return stint.version if stint is not None else None

    def marked(self, version: str) -> Mark | None:
        return self._rec.marks.get(version)

    def rollback_target(self, replica: str, available: Callable[[str], bool] = lambda _v: True) -> str | None:
        """The newest version `replica` served before its current one that is neither marked nor
        gone from disk (`available`), or None."""
        current = self.serving(replica)
        for stint in reversed(self._rec.stints):
            if (stint.replica == replica and stint.ended_at is not None and stint.version != current
                    and stint.version not in self._rec.marks and available(stint.version)):
                return stint.version
        return None

    def pinned(self, available: Callable[[str], bool] = lambda _v: True) -> set[str]:
        """Versions the store must keep: what is served, and what a rollback would return to."""
        replicas = {s.replica for s in self._rec.stints}
        served = {s.version for s in self._rec.stints if s.ended_at is None}
        targets = {self.rollback_target(r, available) for r in replicas}
        return served | {t for t in targets if t is not None}

    def describe(self, label: Callable[[str], str] = str) -> list[dict]:
        """Per version, oldest first: its mark (if any) and every stint of it."""
        out: dict[str, dict] = {}
        for s in self._rec.stints:
            entry = out.setdefault(s.version, {"version": label(s.version), "served": []})
            entry["served"].append({"replica": s.replica, "started_at": s.started_at,
                                    "ended_at": s.ended_at, "ended": s.ended or None,
                                    "reason": s.reason})
        for version in self._rec.marks:  # e.g. a rollout that failed before any replica served it
            out.setdefault(version, {"version": label(version), "served": []})
        for version, entry in out.items():
            mark = self._rec.marks.get(version)
            entry["mark"] = msgspec.to_builtins(mark) if mark is not None else None
        return list(out.values())

    # -- recording
    def observe(self, replica: str, version: str, ending: Ending = "superseded", reason: str = "") -> None:
        """`replica` serves `version` from now on; its previous stint ends with `ending`."""
        stint = self._open(replica)
        if stint is not None and stint.version == version:
            return
        now = time.time()
        if stint is not None:
            stint.ended_at, stint.ended, stint.reason = now, ending, reason
        self._rec.stints.append(Stint(replica, version, now))
        self._save()

    def mark(self, version: str, mark: Literal["rolled_back", "failed"], reason: str = "") -> None:
        self._rec.marks[version] = Mark(mark, time.time(), reason)
        for s in self._rec.stints:  # stints that ended with this failure get its reason
            if s.version == version and s.ended == mark and not s.reason:
                s.reason = reason
        self._save()

    def clear(self, versions: Iterable[str]) -> list[str]:
        """Unmark `versions` (served again on purpose); -> the ones that were marked."""
        cleared = [v for v in versions if self._rec.marks.pop(v, None) is not None]
        if cleared:
            self._save()
        return cleared

    def _open(self, replica: str) -> Stint | None:
        for stint in reversed(self._rec.stints):
            if stint.replica == replica:
                return stint if stint.ended_at is None else None
        return None

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self._rec))
        tmp.replace(self.path)
