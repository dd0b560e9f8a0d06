"""Putting a restarted engine's weights back: a replica whose engine came back serving another
version than its label is reloaded from the checkpoint store before it takes traffic again
(the serving fleet's restore hook)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from yieldgate.serving import EngineControl, Replica
from .config import BridgeConfig
from .engine_arming import EngineArming
from .replica_fleet import engine_label, engine_version
from .rollout_book import RolloutBook, rollout_id
from .schemas import RolloutState

log = logging.getLogger("yieldgate.weights")


class EngineRestore:
    def __init__(self, book: RolloutBook, arming: EngineArming, *,
                 forget_cached: Callable[[str], None], bridge: BridgeConfig) -> None:
        self.book = book
        self.arming = arming
        self.forget_cached = forget_cached
        self.bridge = bridge

    async def restore(self, replica: Replica, found: str) -> None:
        """`replica` came back serving `found` instead of its labelled version (its engine
        restarted): reload the labelled version from the store before it takes traffic again.
        Raises (the fleet keeps the replica out, saying why) when the store does not hold it."""
        async with self.book.lock:  # after any rollout in progress, which may relabel the replica
            self.arming.forget(replica.url)  # a new engine process holds no push token
            found = await engine_version(replica.url)
            want = replica.weight_version
            if found == want:
                return
            store = self.book.store
            source = store.source(engine_label(want))
            if source is None:
                raise RuntimeError(f"it served {want} before its engine restarted and the store "
                                   f"does not hold {want} (has {store.versions()}); push or "
                                   f"roll back to put it back in service")
            state = RolloutState(id=rollout_id(), kind="restore", version=want, source="store",
                                 mode="rolling", tiers=[replica.tier])
            state.state = "running"
            state.note("start", replica.name, f"engine restarted serving {found}; reloading {want}")
            self.book.history.append(state)
            async with EngineControl(replica.url, self.bridge.http_timeout_s) as engine:
                await engine.reload(str(Path(source).resolve()), engine_label(want))
            served = await engine_version(replica.url)
            if served != want:
                state.state, state.reason = "failed", f"engine reports {served} after reloading {want}"
                raise RuntimeError(state.reason)
            replica.label_weights(want)
            replica.note = ""
            self.forget_cached(replica.name)  # the new process's KV cache is empty
            state.state, state.finished_at = "succeeded", time.time()
            state.note("succeeded", replica.name, want)
            log.warning("replica %s: restored %s after an engine restart", replica.name, want)
