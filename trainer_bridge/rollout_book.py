"""The record of the gateway's weight changes: the one rollout that may run (or wait for its
push, with that push's intake), the rollouts before it, and the checkpoint store whose weight
history marks the versions a rollback must not return to. One weight change at a time (`lock`).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any

from yieldgate.serving import Fleet, Replica
from .checkpoint import CheckpointStore
from .errors import RolloutConflict
from .intake import PushIntake
from .replica_fleet import ReplicaFleet, engine_label, gateway_label
from .schemas import RolloutState

log = logging.getLogger("yieldgate.weights")


def rollout_id() -> str:
    return "ro_" + secrets.token_hex(6)


class RolloutBook:
    def __init__(self, fleet: Fleet, open_store: Callable[[], CheckpointStore]) -> None:
        """`open_store()` makes the checkpoint store at its first use (the launch weights it
        holds as base may have to be generated)."""
        self.fleet = fleet
        self._open_store = open_store
        self._store: CheckpointStore | None = None
        self.lock = asyncio.Lock()
        self.current: RolloutState | None = None
        self.history: list[RolloutState] = []
        self.intake: PushIntake | None = None  # the newest push's: only it takes pushes

    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            self._store = self._open_store()
        return self._store

    def begin(self, state: RolloutState) -> None:
        """`state` becomes the current rollout; raises RolloutConflict while another runs."""
        if self.current is not None and self.current.state == "running":
            raise RolloutConflict(f"rollout {self.current.id} is running", code="rollout_in_progress")
        if self.current is not None and self.current.state == "awaiting_push":
            # A push that never came must not block the fleet: the newer request replaces it.
            self.drop_push(self.current, f"superseded by {state.id} before any push arrived",
                           why="superseded")
        if self.current is not None:
            self.history.append(self.current)
        self.current = state

    def intake_of(self, state: RolloutState) -> PushIntake | None:
        intake = self.intake
        return intake if intake is not None and intake.state.id == state.id else None

    def drop_push(self, state: RolloutState, reason: str, why: str) -> None:
        """Fail a push still awaiting its trainer: nothing was applied, so nothing is restored.
        Its intake takes no more calls and a wave it drained early goes back (`why` says so)."""
        intake = self.intake_of(state)
        if intake is not None:
            intake.readmit_early(why)
        state.state, state.reason, state.finished_at = "failed", reason, time.time()
        state.note("failed", detail=reason)
        self.mark_failed(state)
        if intake is not None:
            self.intake = None

    def fail(self, state: RolloutState, reason: str, fleet: ReplicaFleet, url: str | None) -> None:
        state.state = "failed"
        state.reason = reason
        state.failed_replica = fleet.by_url[url].name if url in fleet.by_url else ""
        state.note("failed", state.failed_replica, reason)
        log.error("rollout %s of %s failed: %s", state.id, state.version, reason)
        self.mark_failed(state)

    def mark_failed(self, state: RolloutState) -> None:
        """A rollout that failed marks its version: no later rollback returns to it (unless some
        replica serves it anyway, e.g. a re-push of the version served now failed)."""
        version = engine_label(state.version)
        if state.kind != "rollout" or not state.version:
            return
        if any(r.admitted and engine_label(r.weight_version) == version for r in self.fleet.replicas.values()):
            return
        self.store.history.mark(version, "failed", state.reason)

    def observe(self, replicas: list[Replica]) -> None:
        """History: what each replica serves as a rollout starts (a replica served something the
        history does not know, e.g. after an engine restart or before the first rollout)."""
        for r in replicas:
            self.store.history.observe(r.name, engine_label(r.weight_version), "replaced",
                                       f"engine found serving {r.weight_version}")

    def weight_history(self) -> list[dict[str, Any]]:
        """What each replica served and how it ended, as the gateway labels versions."""
        entries = self.store.history.describe(gateway_label)
        for entry in entries:
            # base counts as stored: the launch weights are read from the model once evicted.
            entry["stored"] = self.store.source(engine_label(entry["version"])) is not None
        return entries

    def rollback_targets(self) -> dict[str, str | None]:
        """What a rollback would return each replica to now."""
        targets = {name: self.store.rollback_target(name) for name in self.fleet.replicas}
        return {name: gateway_label(v) if v is not None else None for name, v in targets.items()}
