"""What each replica served, when, and how it ended: the record rollback chooses from.

A rollback returns each replica to the version it served before the current one, skipping any
version that was itself rolled back or whose rollout failed (marked here). The record is a JSON
file beside the checkpoints (`CheckpointStore.history`), so a restarted gateway answers the same.
Versions are the engines' names ("default" = the launch weights). The record is bounded: each
replica keeps its newest `keep_stints` stints, plus the one its rollback would return to.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
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


Available = Callable[[str], bool]  # version -> can it still be loaded (e.g. its checkpoint exists)


class WeightHistory:
    def __init__(self, path: str | Path, available: Available = lambda _v: True,
                 keep_stints: int = 100) -> None:
        """`available`: the default for `rollback_target` (a version gone from disk is skipped)."""
        self.path = Path(path)
        self.available = available
        self.keep_stints = keep_stints
        self._rec = msgspec.json.decode(self.path.read_bytes(), type=_Record) \
            if self.path.exists() else _Record()

    # -- reading
    def serving(self, replica: str) -> str | None:
        stint = self._open(replica)
        return stint.version if stint is not None else None

    def marked(self, version: str) -> Mark | None:
        return self._rec.marks.get(version)

    def rollback_target(self, replica: str, available: Available | None = None) -> str | None:
        """The newest version `replica` served before its current one that is neither marked nor
        gone from disk (`available`), or None."""
        stint = next(self._candidates(replica, available or self.available), None)
        return stint.version if stint is not None else None

    def _candidates(self, replica: str, available: Available) -> Iterator[Stint]:
        """`replica`'s ended stints a rollback may return to, newest first."""
        current = self.serving(replica)
        for stint in reversed(self._rec.stints):
            if (stint.replica == replica and stint.ended_at is not None and stint.version != current
                    and stint.version not in self._rec.marks and available(stint.version)):
                yield stint

    def pinned(self, available: Available | None = None) -> set[str]:
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
        self._trim(replica)
        self._save()

    def mark(self, version: str, mark: Literal["rolled_back", "failed"], reason: str = "") -> None:
        self._rec.marks[version] = Mark(mark, time.time(), reason)
        for s in self._rec.stints:  # stints that ended with this failure get its reason
            if s.version == version and s.ended == mark and not s.reason:
                s.reason = reason
        self._trim_marks()
        self._save()

    def clear(self, versions: Iterable[str]) -> list[str]:
        """Unmark `versions` (served again on purpose); -> the ones that were marked."""
        cleared = [v for v in versions if self._rec.marks.pop(v, None) is not None]
        if cleared:
            self._save()
        return cleared

    def _trim(self, replica: str) -> None:
        """Drop `replica`'s oldest ended stints beyond `keep_stints`, but never the one its
        rollback returns to, nor the one after (a failed rollout's restore is recorded before its
        version is marked, and the target moves one back). Marks stay: a version a stint still
        names must stay skipped."""
        mine = [s for s in self._rec.stints if s.replica == replica]
        excess = len(mine) - self.keep_stints
        if excess <= 0:
            return
        newest: dict[str, Stint] = {}  # the first two versions a rollback would try
        for stint in self._candidates(replica, self.available):
            if len(newest) == 2:
                break
            newest.setdefault(stint.version, stint)
        keep = {id(s) for s in newest.values()}
        oldest = [s for s in mine if s.ended_at is not None and id(s) not in keep][:excess]
        drop = {id(s) for s in oldest}
        self._rec.stints = [s for s in self._rec.stints if id(s) not in drop]
        self._trim_marks()

    def _trim_marks(self) -> None:
        """Marks of versions no stint names (trimmed away, or a rollout that failed before any
        replica served it) choose nothing: only the newest `keep_stints` of them are kept."""
        named = {s.version for s in self._rec.stints}
        loose = sorted((v for v in self._rec.marks if v not in named), key=lambda v: self._rec.marks[v].at)
        for version in loose[: max(len(loose) - self.keep_stints, 0)]:
            del self._rec.marks[version]

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
