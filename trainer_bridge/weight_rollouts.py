"""Rollouts over the gateway's fleet: new weights (a push's or a checkpoint's) wave by wave,
and rollbacks to stored versions. Each runs under the book's lock, on the replicas healthy when
it starts, and leaves its steps on its `RolloutState` timeline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from yieldgate.serving import EngineControl, Fleet, Replica
from .background import BackgroundTasks
from .config import BridgeConfig
from .engine_arming import EngineArming
from .errors import InvalidWeightsRequest, RolloutConflict, RolloutFailed
from .replica_fleet import ReplicaFleet, engine_label, gateway_label, replicas_to_update
from .rollout import Rollout
from .rollout_book import RolloutBook, rollout_id
from .schemas import Canary, CheckpointSource, RollbackRequest, RolloutState, WeightsRequest

log = logging.getLogger("yieldgate.weights")


class WeightRollouts:
    def __init__(self, fleet: Fleet, book: RolloutBook, arming: EngineArming, tasks: BackgroundTasks,
                 *, model: str, forget_cached: Callable[[str], None], bridge: BridgeConfig) -> None:
        """`model`: the name the engines serve (a canary asks for it); `forget_cached(name)`: drop
        a replica's prefix-index entries (its engine's cache is empty after a swap)."""
        self.fleet = fleet
        self.book = book
        self.arming = arming
        self.tasks = tasks
        self.model = model
        self.forget_cached = forget_cached
        self.bridge = bridge

    async def from_checkpoint(self, request: WeightsRequest) -> RolloutState:
        """Roll out a safetensors checkpoint on disk (waits for the end if `request.wait`)."""
        assert isinstance(request.source, CheckpointSource)
        path = Path(request.source.checkpoint)
        if not request.version:
            raise InvalidWeightsRequest("version is required", param="version")
        if not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
            raise InvalidWeightsRequest(f"no safetensors checkpoint in {path}", param="source")
        replicas = replicas_to_update(self.fleet, request.tier)
        state = RolloutState(id=rollout_id(), kind="rollout", version=request.version,
                             source=f"checkpoint:{path}", mode=request.mode,
                             tiers=[request.tier] if request.tier else self.fleet.tiers())
        self.book.begin(state)

        async def load() -> dict[str, Any]:
            from safetensors.torch import load_file
            out: dict[str, Any] = {}
            for f in sorted(path.glob("*.safetensors")):
                out.update(await asyncio.to_thread(load_file, str(f)))
            return out

        async def run() -> None:
            try:
                weights = await load()
            except Exception as exc:  # noqa: BLE001 - unreadable checkpoint: nothing was touched
                state.state, state.reason, state.finished_at = "failed", f"{type(exc).__name__}: {exc}", time.time()
                state.note("failed", detail=state.reason)
                self.book.mark_failed(state)
                return
            await self.run(state, replicas, weights, request, checkpoint=path)

        task = self.tasks.spawn(run())
        if request.wait:
            await asyncio.shield(task)
        return state

    async def run(self, state: RolloutState, replicas: list[Replica], weights: Any,
                  request: WeightsRequest, checkpoint: Path | None = None,
                  staged: dict[str, str] | None = None) -> None:
        """Swap `weights` into `replicas` (`staged`: engine URL -> the session each engine staged
        a fan-out push in); the state says how it ended, this never raises."""
        async with self.book.lock:
            state.state = "running"
            state.note("start", detail=f"{len(replicas)} replica(s), mode {request.mode}")
            self.book.observe(replicas)
            fleet = ReplicaFleet(replicas, state, self.fleet, self.forget_cached)
            evaluate = self._canary(request.canary, state) if request.canary else None
            rollout = Rollout(fleet, self.book.store, mode=request.mode, evaluate=evaluate,
                              config=self.bridge, current_token=self.arming.token,
                              label=f"rollout {state.id}")
            try:
                # run() arms or rotates every engine to a fresh token (current = ours).
                await rollout.run(weights, engine_label(state.version), staged=staged,
                                  checkpoint=checkpoint)
            except RolloutFailed as exc:
                self.book.fail(state, exc.reason, fleet, exc.replica)
            except Exception as exc:  # noqa: BLE001 - the state must say why, whatever broke
                log.exception("rollout %s crashed", state.id)
                self.book.fail(state, f"{type(exc).__name__}: {exc}", fleet, None)
            else:
                state.state = "succeeded"
                state.note("succeeded")
                self.book.store.history.clear([engine_label(state.version)])  # served again: fine now
            finally:
                self.arming.remember(rollout.token)
                state.finished_at = time.time()

    def _canary(self, canary: Canary, state: RolloutState) -> Callable[[str], Awaitable[bool]]:
        async def evaluate(url: str) -> bool:
            # Straight to the engine: the replica is out of routing while it is being verified.
            async with EngineControl(url, 60.0) as engine:
                text = await engine.complete(self.model, canary.prompt, canary.max_tokens)
            ok = canary.expect_substring in text
            names = {r.url: r.name for r in self.fleet.replicas.values()}
            state.note("canary", names.get(url, url), f"{'pass' if ok else 'fail'}: {text[:80]!r}")
            return ok

        return evaluate

    async def rollback(self, request: RollbackRequest) -> tuple[RolloutState, dict[str, Any]]:
        """-> (the rollback's state, how its targets were chosen). Without `to`, each replica goes
        back to what it served before (the history skips versions rolled back or failed)."""
        replicas = replicas_to_update(self.fleet, request.tier)
        store = self.book.store
        named = request.to or request.to_version
        self.book.observe(replicas)
        if named:
            targets = {r.url: engine_label(named) for r in replicas}
            if store.source(engine_label(named)) is None:
                raise RolloutConflict(f"no checkpoint of {named!r} (have {store.versions()})", code="no_checkpoint")
        else:
            found = {r.url: store.rollback_target(r.name) for r in replicas}
            if None in found.values():
                stuck = [r.name for r in replicas if found[r.url] is None]
                raise RolloutConflict(f"nothing to roll back to for {stuck}: no earlier version that was "
                               f"neither rolled back nor failed is stored (have {store.versions()})",
                               code="no_checkpoint")
            targets = {url: str(v) for url, v in found.items()}
        labels = {gateway_label(v) for v in targets.values()}
        state = RolloutState(id=rollout_id(), kind="rollback",
                             version=labels.pop() if len(labels) == 1 else "per-replica",
                             source="store", mode="rolling",
                             tiers=[request.tier] if request.tier else self.fleet.tiers())
        self.book.begin(state)
        answer: dict[str, Any] = {
            "chosen_by": "request" if named else "history",
            "targets": {r.name: gateway_label(targets[r.url]) for r in replicas}}
        if named:
            mark = store.history.marked(engine_label(named))
            if mark is not None:
                answer["notice"] = (f"{named} had been marked {mark.mark} ({mark.reason}); "
                                    f"served again because the request named it")
        async with self.book.lock:
            fleet = ReplicaFleet(replicas, state, forget_cached=self.forget_cached)
            rollout = Rollout(fleet, store, config=self.bridge, label=f"rollback {state.id}")
            state.note("start", detail=f"back to {state.version} ({answer['chosen_by']})"
                                       + (f"; {answer['notice']}" if "notice" in answer else ""))
            # The versions left are marked now: the operator judged them bad, even if this fails.
            for r in replicas:
                left = engine_label(r.weight_version)
                if left != targets[r.url]:
                    store.history.mark(left, "rolled_back", f"rollback {state.id}")
            store.history.clear(set(targets.values()))
            try:
                await rollout.roll_back({r.url: targets[r.url] for r in replicas})
            except Exception as exc:  # noqa: BLE001
                reason = exc.reason if isinstance(exc, RolloutFailed) else f"{type(exc).__name__}: {exc}"
                url = exc.replica if isinstance(exc, RolloutFailed) else None
                self.book.fail(state, reason, fleet, url)
                # A replica left half-done stays out of routing; healthy ones come back.
                for url_, rep in fleet.by_url.items():
                    if not rep.admitted and rep.name != state.failed_replica:
                        await fleet.set_routable(url_, True)
            else:
                state.state = "succeeded"
                state.note("succeeded")
            state.finished_at = time.time()
        return state, answer
