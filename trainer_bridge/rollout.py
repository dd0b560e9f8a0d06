"""Rolling a new weight version through a fleet without serving a request from half-loaded
weights, and with a one-call way back.

Whoever routes traffic plugs in through `FleetControl` (`fleet_control.py`). Before any replica
leaves routing, everything that does not need a drained engine runs at once: version lookups,
the N-1 checkpoints, push-token rotation, and *staging* the new weights on every plugin engine
in parallel (streamed and verified into its buffers while it keeps serving); the new version's
checkpoint is written meanwhile. Then a strategy per mode swaps the replicas with the public
steps `take_out` (out of routing, drained), `update` (apply the staged weights, or reload a
checkpoint for engines without the plugin; the engine resets its prefix cache), `verify`
(health + version + optional eval) and `admit`:

- "rolling": one wave at a time. Replicas swap together when every tier keeps a routable
  replica of its own meanwhile (a tier whose only replica is out borrows the others, so the
  fleet keeps at least one). The first wave drains while the preparation runs.
- "all_at_once": the fleet holds new requests (the gateway queues them; bare engines pause),
  every replica drains, applies in parallel, is verified and re-admitted, then the hold ends.

Any failure restores the previous version from the on-disk checkpoint on every replica this
rollout touched (`restore`), then raises RolloutFailed(reason). What each replica serves is
recorded in the store's `WeightHistory` under `FleetControl.name`; `rollback()` follows it, and
`roll_back(targets)` is the one implementation of taking replicas back.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol

import httpx
import msgspec

from yieldgate.serving import EngineCallFailed, EngineControl
from .checkpoint import CheckpointStore
from .config import BridgeConfig
from .errors import BridgeError, PushFailed, RolloutFailed
from .fleet_control import EngineFleet, FleetControl, swap_waves
from .history import Ending
from .push import ModelLike, _weights, make_push_token, push, stage
from .weights import WeightSet

__all__ = ["EngineFleet", "FleetControl", "Rollout", "RolloutReport", "default_store",
           "rotate_push_token", "swap_waves"]

log = logging.getLogger(__name__)

Evaluate = Callable[[str], Awaitable[bool]]  # replica URL -> passes?
Mode = Literal["rolling", "all_at_once"]
# vLLM's name for the weights an engine launched with.
ENGINE_BASE_VERSION = "default"


class RolloutReport(msgspec.Struct):
    version: str
    mode: str
    replicas: list[str]
    previous: dict[str, str]  # replica -> version it served before
    methods: dict[str, str]  # replica -> "push" | "reload"
    seconds: float


@dataclass
class Swap:
    """One run's state, handed from step to step."""

    version: str
    wset: WeightSet
    token: str = ""
    checkpoint: Path | None = None     # reload every replica from here instead of staging
    previous: dict[str, str] = field(default_factory=dict)
    touched: list[str] = field(default_factory=list)   # replicas whose weights were changed
    methods: dict[str, str] = field(default_factory=dict)
    early: dict[str, asyncio.Future] = field(default_factory=dict)  # drains begun during prep


class Strategy(Protocol):
    def first_wave(self, rollout: Rollout, replicas: list[str]) -> list[str]:
        """Replicas that may start draining while the rollout prepares."""

    async def swap(self, rollout: Rollout, replicas: list[str], swap: Swap) -> None: ...


class Rolling:
    def first_wave(self, rollout: Rollout, replicas: list[str]) -> list[str]:
        return swap_waves(replicas, rollout.fleet.tier)[0]

    async def swap(self, rollout: Rollout, replicas: list[str], swap: Swap) -> None:
        for wave in swap_waves(replicas, rollout.fleet.tier):
            outcomes = await asyncio.gather(*(self._one(rollout, r, swap) for r in wave),
                                            return_exceptions=True)
            for outcome in outcomes:
                if isinstance(outcome, BaseException):
                    raise outcome

    async def _one(self, rollout: Rollout, replica: str, swap: Swap) -> None:
        drained = swap.early.pop(replica, None)
        try:
            await (drained if drained is not None else rollout.take_out(replica))
        except BaseException:
            await rollout.fleet.set_routable(replica, True)  # untouched: still on the old version
            raise
        swap.touched.append(replica)
        swap.methods[replica] = await rollout.update(replica, swap)
        await rollout.verify(replica, swap.version)
        await rollout.admit(replica, swap.version, "superseded", rollout.reason(swap.version))


class AllAtOnce:
    """One drain for every replica while the fleet holds new requests (they wait, none fails).
    Held requests go once every replica serves the new weights, or, after a failure, once the
    old ones are back (restored here, so `touched` is emptied for the caller's abort)."""

    def first_wave(self, rollout: Rollout, replicas: list[str]) -> list[str]:
        return []

    async def swap(self, rollout: Rollout, replicas: list[str], swap: Swap) -> None:
        fleet = rollout.fleet
        await fleet.hold(replicas)
        fleet.note("hold", detail="new requests wait while every replica swaps")
        try:
            await self._swap_all(rollout, replicas, swap)
        except BaseException:
            await rollout.restore(swap.touched, swap.previous)
            swap.touched.clear()
            raise
        finally:
            await fleet.release(replicas)
            fleet.note("released")

    async def _swap_all(self, rollout: Rollout, replicas: list[str], swap: Swap) -> None:
        drains = await asyncio.gather(*(rollout.take_out(r) for r in replicas), return_exceptions=True)
        failed = next((d for d in drains if isinstance(d, BaseException)), None)
        if failed is not None:
            for r in replicas:  # untouched: they still serve the old version
                await rollout.fleet.set_routable(r, True)
            raise failed
        swap.touched.extend(replicas)
        # Every update ends (or fails) before a failure is raised: the restore must not race one.
        results = await asyncio.gather(*(rollout.update(r, swap) for r in replicas),
                                       return_exceptions=True)
        for replica, result in zip(replicas, results):
            if isinstance(result, Exception) and not isinstance(result, RolloutFailed):
                raise RolloutFailed(f"{type(result).__name__}: {result}", replica) from result
            if isinstance(result, BaseException):
                raise result
        swap.methods.update(zip(replicas, results))
        await asyncio.gather(*(rollout.verify(r, swap.version) for r in replicas))
        for r in replicas:
            await rollout.admit(r, swap.version, "superseded", rollout.reason(swap.version))


STRATEGIES: dict[str, Strategy] = {"rolling": Rolling(), "all_at_once": AllAtOnce()}


class Rollout:
    def __init__(
        self,
        fleet: FleetControl,
        store: CheckpointStore,
        *,
        mode: Mode = "rolling",
        evaluate: Evaluate | None = None,
        config: BridgeConfig | None = None,
        current_token: str | None = None,
        label: str = "",
    ) -> None:
        """`label` names the rollout in the history's reasons ("rollout ro_1f2e"; default
        "rollout of <version>")."""
        self.fleet = fleet
        self.store = store
        self.mode = mode
        self.evaluate = evaluate
        self.config = config or BridgeConfig()
        self.label = label
        # The push token engines are armed with; each rollout rotates it.
        self.token = current_token
        self._backends: dict[str, str | None] = {}
        self._sessions: dict[str, str] = {}  # replica -> staged session awaiting its swap
        self._saving: asyncio.Future | None = None

    def reason(self, version: str) -> str:
        return self.label or f"rollout of {version}"

    async def run(
        self, weights: ModelLike | asyncio.Future, version: str,
        staged: Mapping[str, str] | None = None, checkpoint: Path | None = None,
    ) -> RolloutReport:
        """`staged`: replica -> session the trainer already streamed `weights` into (straight to
        the engines, armed with `self.token`); those replicas skip token rotation and staging.
        `weights` may then be a future (a copy still arriving): only the checkpoint waits for it,
        and a replica without a session reloads that checkpoint. `checkpoint`: every replica
        reloads this directory (nothing is staged); `weights` are what the store keeps of it."""
        started = time.perf_counter()
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        if not replicas:
            raise RolloutFailed("fleet has no replicas")
        pending = weights if isinstance(weights, asyncio.Future) else None
        if pending is not None and not staged:
            raise ValueError("weights still arriving need pre-staged replicas")
        swap = Swap(version, WeightSet([]) if pending is not None else _weights(weights, None),
                    checkpoint=checkpoint)
        self._sessions = {r.rstrip("/"): s for r, s in (staged or {}).items()}
        self._saving = None
        strategy = STRATEGIES[self.mode]
        # The first wave drains while the preparation below runs: its in-flight requests finish
        # on the old weights meanwhile, and nothing of it is touched until both are done.
        swap.early = {r: asyncio.ensure_future(self.take_out(r))
                      for r in strategy.first_wave(self, replicas)}
        await self._prepare(replicas, swap, pending)
        try:
            await strategy.swap(self, replicas, swap)
            await self._saved(version, keep=True)
        except RolloutFailed as exc:
            await self._abort(swap)
            self._mark_failed(version, exc.reason, swap.previous)
            raise RolloutFailed(exc.reason, exc.replica) from exc
        except Exception as exc:  # noqa: BLE001 - any failure means: put the old weights back
            reason = f"{type(exc).__name__}: {exc}"
            await self._abort(swap)
            self._mark_failed(version, reason, swap.previous)
            raise RolloutFailed(reason, swap.touched[-1] if swap.touched else None) from exc
        self.store.history.clear([version])  # served on purpose again: no longer skipped
        return RolloutReport(version, self.mode, replicas, swap.previous, swap.methods,
                             time.perf_counter() - started)

    async def _prepare(self, replicas: list[str], swap: Swap, pending: asyncio.Future | None) -> None:
        """Everything that leaves every replica serving: versions and N-1 checkpoints (then this
        version's checkpoint starts writing), token rotation and staging, all at once. On a
        failure nothing was touched: drains begun early are undone and the version is marked."""
        prepared = await asyncio.gather(self._checkpoints(replicas, swap, pending),
                                        self._stage(replicas, swap), return_exceptions=True)
        for result in prepared:
            if isinstance(result, BaseException):
                await asyncio.gather(*swap.early.values(), return_exceptions=True)
                for r in swap.early:  # untouched: they still serve the old version
                    await self.fleet.set_routable(r, True)
                await self._drop_staged()
                await self._saved(swap.version, keep=swap.version in swap.previous.values())
                failure = result if isinstance(result, RolloutFailed) else \
                    RolloutFailed(f"{type(result).__name__}: {result}")
                self._mark_failed(swap.version, failure.reason, swap.previous)
                raise failure from result
        for r, prev in swap.previous.items():
            self._served(r, prev, "replaced", f"engine found serving {prev}")

    async def _checkpoints(self, replicas: list[str], swap: Swap, pending: asyncio.Future | None) -> None:
        found = await asyncio.gather(*(self.fleet.weight_version(r) for r in replicas))
        swap.previous = dict(zip(replicas, found))
        for prev in set(swap.previous.values()):
            await asyncio.to_thread(self._ensure_checkpoint, prev)

        async def save() -> None:
            ready = _weights(await pending, None) if pending is not None else swap.wset
            # The versions served now stay on disk until this one is through: a failure
            # restores them from there.
            await asyncio.to_thread(self.store.save, swap.version, ready.state_dict(),
                                    set(swap.previous.values()))

        self._saving = asyncio.ensure_future(save())

    async def _stage(self, replicas: list[str], swap: Swap) -> None:
        """Rotate the push token on every plugin engine, then stage the weights on them (in
        parallel, one serialization). Replicas the trainer staged keep the current token."""
        if self._sessions:
            self._backends = {r: "yieldgate" for r in self._sessions}
            assert self.token is not None, "pre-staged replicas are armed with the current token"
            swap.token = self.token
            return
        swap.token = await self._rotate_token(replicas)
        # A checkpoint rollout reloads from disk; only pushed weights are staged over the wire.
        targets = [] if swap.checkpoint is not None else \
            [r for r in replicas if self._backends.get(r) == "yieldgate"]
        if not targets:
            return
        try:
            # The trainer side of a push streams from threads (one per engine, blocking calls).
            sessions, seconds = await asyncio.to_thread(stage, swap.wset, targets, swap.token, self.config)
        except PushFailed as exc:
            url, cause = next(iter(exc.failures.items()))
            raise RolloutFailed(f"staging failed: {type(cause).__name__}: {cause}", url) from exc
        self._sessions = sessions
        self.fleet.note("staged", detail=f"{swap.wset.total_bytes} bytes on {len(targets)} engine(s), "
                                         f"verified in {seconds:.2f}s")

    # --- steps
    async def take_out(self, replica: str) -> None:
        """Out of routing, then wait (bounded) until nothing runs on it."""
        await self.fleet.set_routable(replica, False)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (n := await self.fleet.inflight(replica)) > 0:
            if time.monotonic() > deadline:
                raise RolloutFailed(f"drain timed out with {n} request(s) in flight", replica)
            await asyncio.sleep(0.02)

    async def update(self, replica: str, swap: Swap) -> str:
        """Load `swap.version` into a drained replica. -> "push" or "reload" (how)."""
        self.fleet.weights_changed(replica, None)
        self.fleet.note("update", replica)
        method = await self._load(replica, swap)
        self.fleet.note("updated", replica, method)
        return method

    async def _load(self, replica: str, swap: Swap) -> str:
        if swap.checkpoint is not None:
            await self._reload(replica, swap.checkpoint, swap.version)
            return "reload"
        session = self._sessions.pop(replica, None)
        if session is not None:
            async with EngineControl(replica, self.config.http_timeout_s) as engine:
                await engine.apply(session, swap.version, self.config.stream_timeout_s)
            return "push"
        if self._backends.get(replica) == "yieldgate":
            await asyncio.to_thread(
                push, swap.wset, swap.version, [replica], token=swap.token, init=False,
                progress=False, config=self.config,
            )
            return "push"
        if self._saving is not None:
            await asyncio.shield(self._saving)  # the reload reads the checkpoint being written
        await self._reload(replica, self.store.path(swap.version), swap.version)
        return "reload"

    async def _reload(self, replica: str, path: str | Path, version: str) -> None:
        async with EngineControl(replica, self.config.http_timeout_s) as engine:
            await engine.reload(str(Path(path).resolve()), version)

    async def verify(self, replica: str, version: str, evaluate: bool = True) -> str:
        """Health, the version the engine reports (== `version`), then the evaluation.
        -> the version served, which the fleet labels the replica with."""
        async with EngineControl(replica, self.config.verify_timeout_s) as engine:
            healthy, served = await asyncio.gather(engine.healthy(), engine.weight_version())
        if not healthy:
            raise RolloutFailed("engine unhealthy after update", replica)
        if served != version:
            raise RolloutFailed(f"engine reports version {served!r}, expected {version!r}", replica)
        if evaluate and self.evaluate is not None and not await self.evaluate(replica):
            raise RolloutFailed("evaluation callback rejected the new weights", replica)
        self.fleet.weights_changed(replica, served)
        return served

    async def admit(self, replica: str, version: str, ending: Ending, reason: str = "") -> None:
        """Back into routing, serving `version` (its previous version's stint ended `ending`)."""
        await self.fleet.set_routable(replica, True)
        self._served(replica, version, ending, reason)

    async def restore(self, replicas: list[str], previous: Mapping[str, str]) -> None:
        """After a failure: reload `previous[r]` on each replica and re-admit it. One whose
        version is not on disk, or whose reload fails, stays out (it serves unknown weights)."""
        for replica in replicas:
            self.fleet.weights_changed(replica, None)
            prev = previous[replica]
            source = self.store.source(prev)
            if source is None:
                log.error("restoring %s to %s impossible: no checkpoint on disk", replica, prev)
                continue
            try:
                # Out of routing and drained first: a request spanning the reload would be
                # answered by one version and labelled with the other.
                await self.take_out(replica)
            except RolloutFailed as exc:
                log.error("restoring %s: %s; reloading anyway", replica, exc.reason)
            try:
                await self._reload(replica, source, prev)
            except (BridgeError, EngineCallFailed, httpx.HTTPError, ValueError) as exc:
                log.error("restoring %s to %s failed: %s", replica, prev, exc)
                continue
            await self.admit(replica, prev, "failed")

    async def roll_back(self, targets: Mapping[str, str]) -> None:
        """Take each replica back to `targets[replica]` from the store, one at a time, with the
        steps of a rolling update (out, drained, reload, verify, admit). Raises RolloutFailed at
        the first replica that fails; the ones before it serve their target."""
        for replica, target in targets.items():
            try:
                await self.take_out(replica)
            except BaseException:
                await self.fleet.set_routable(replica, True)  # untouched: it still serves its version
                raise
            source = self.store.source(target)
            if source is None:
                raise RolloutFailed(f"no checkpoint of {target!r} on disk", replica)
            self.fleet.weights_changed(replica, None)
            self.fleet.note("update", replica)
            await self._reload(replica, source, target)
            self.fleet.note("updated", replica, "reload")
            await self.verify(replica, target, evaluate=False)  # known weights: no canary
            await self.admit(replica, target, "rolled_back", self.label)

    async def rollback(self, to_version: str | None = None) -> dict[str, str]:
        """Put every replica back on what it served before its current version (the history
        skips versions rolled back or failed), or on `to_version`. The versions left are marked
        rolled back. -> replica -> the version it serves now."""
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        found = await asyncio.gather(*(self.fleet.weight_version(r) for r in replicas))
        current = dict(zip(replicas, found))
        for r, version in current.items():
            self._served(r, version, "replaced", f"engine found serving {version}")
        targets = self.rollback_targets(replicas, to_version)
        for r in replicas:
            if current[r] != targets[r]:
                self.store.history.mark(current[r], "rolled_back", f"rolled back to {targets[r]}")
        self.store.history.clear(set(targets.values()))
        await self.roll_back(targets)
        return targets

    def rollback_targets(self, replicas: Sequence[str], to_version: str | None = None) -> dict[str, str]:
        """What `rollback` would put each replica on; raises RolloutFailed if one has nothing."""
        if to_version is not None:
            if self.store.source(to_version) is None:
                raise RolloutFailed(f"no checkpoint for version {to_version!r} to roll back to")
            return {r: to_version for r in replicas}
        targets = {r: self.store.rollback_target(self.fleet.name(r)) for r in replicas}
        stuck = [r for r, t in targets.items() if t is None]
        if stuck:
            raise RolloutFailed(f"nothing to roll back to for {stuck}: no earlier version that was "
                                f"neither rolled back nor failed is stored ({self.store.versions()})")
        return {r: str(t) for r, t in targets.items()}

    # --- failure and bookkeeping
    async def _abort(self, swap: Swap) -> None:
        await self._drop_staged()
        await self.restore(swap.touched, swap.previous)
        await self._saved(swap.version, keep=swap.version in swap.previous.values())

    async def _saved(self, version: str, keep: bool) -> None:
        """Wait for this version's checkpoint; `keep=False` forgets it (a rollout that failed)."""
        saving, self._saving = self._saving, None
        if saving is None:
            return  # never started writing it: whatever the store holds under this name stays
        if keep:
            try:
                await saving
            except Exception as exc:  # e.g. the gateway's copy of a push failed its checksums
                self._saving = saving  # the abort decides whether what it left is discarded
                raise RolloutFailed(f"checkpoint of {version!r} not saved: {type(exc).__name__}: {exc}") from exc
            self.fleet.note("checkpointed", detail=f"{self.store.versions()}")
        else:
            await asyncio.gather(saving, return_exceptions=True)
            await asyncio.to_thread(self.store.discard, version)

    async def _drop_staged(self) -> None:
        sessions, self._sessions = self._sessions, {}

        async def discard(url: str) -> None:
            try:
                async with EngineControl(url, 60.0) as engine:
                    await engine.discard()
            except Exception as exc:  # noqa: BLE001 - clean-up on a failure path; the cause is raised
                log.warning("discarding what %s staged failed: %s", url, exc)

        await asyncio.gather(*(discard(r) for r in sessions))

    def _served(self, replica: str, version: str, ending: Ending, reason: str = "") -> None:
        """History: `replica` serves `version` from now on (its previous stint ended `ending`)."""
        self.store.history.observe(self.fleet.name(replica), version, ending, reason)

    def _mark_failed(self, version: str, reason: str, previous: Mapping[str, str]) -> None:
        """A failed rollout's version is skipped by later rollbacks, unless it is what some
        replica served before (a re-push of the served version failed: that version is fine)."""
        if version not in previous.values():
            self.store.history.mark(version, "failed", reason)

    async def _rotate_token(self, replicas: list[str]) -> str:
        token = make_push_token()
        self._backends = await rotate_push_token(replicas, token, self.token)
        self.token = token
        self.fleet.note("armed", detail="push token rotated on every engine")
        return token

    def _ensure_checkpoint(self, version: str) -> None:
        if self.store.has(version):
            return
        if version == ENGINE_BASE_VERSION:
            # What vLLM reports before any update: the weights it launched with.
            self.store.adopt(version, self.store.base_model_dir)
            return
        log.warning("no checkpoint on disk for served version %r: rollback to it impossible", version)


async def rotate_push_token(
    replicas: Sequence[str], token: str, current: str | None
) -> dict[str, str | None]:
    """Arm every plugin engine with `token` (rotating from `current`), in parallel.
    -> each replica's weight-transfer backend ("yieldgate", another, or None): the arm call
    doubles as the probe, since an engine without our backend refuses the token's shape.
    Raises RolloutFailed, after handing the engines that took `token` back to `current`."""

    async def arm(replica: str) -> str | None:
        async with EngineControl(replica, 60.0) as engine:
            try:
                await engine.arm(token, current)
                return "yieldgate"
            except EngineCallFailed:
                backend = await engine.transfer_backend()
                if backend == "yieldgate":
                    raise
                return backend

    async def hand_back(replica: str) -> None:
        try:
            async with EngineControl(replica, 60.0) as engine:
                await engine.arm(str(current), token)
        except Exception as exc:  # noqa: BLE001 - clean-up on a failure path; the cause is raised
            log.warning("handing %s back its push token failed: %s", replica, exc)

    results = await asyncio.gather(*(arm(r) for r in replicas), return_exceptions=True)
    backends = {r: b for r, b in zip(replicas, results) if not isinstance(b, BaseException)}
    failed = [(r, e) for r, e in zip(replicas, results) if isinstance(e, BaseException)]
    if failed:
        if current:
            await asyncio.gather(*(hand_back(r) for r, b in backends.items() if b == "yieldgate"))
        replica, exc = failed[0]
        raise RolloutFailed(f"arming failed: {type(exc).__name__}: {exc}", replica) from exc
    return backends


def default_store(base_model_dir: str | Path, config: BridgeConfig | None = None) -> CheckpointStore:
    cfg = config or BridgeConfig()
    root = cfg.checkpoint_root or os.path.join(
        os.environ.get("YIELDGATE_HOME") or os.path.expanduser("~/.cache/yieldgate"), "versions"
    )
    return CheckpointStore(root, base_model_dir, keep=cfg.keep_versions)
