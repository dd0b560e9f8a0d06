"""Rolling a new weight version through a fleet without serving a request from half-loaded
weights, and with a one-call way back.

The gateway plugs its fleet in through `Fleet` (three methods, plus optional `tier`,
`weight_version` and `hold`/`release`).
Before any replica leaves routing, everything that does not need a drained engine runs at once:
version lookups, the N-1 checkpoints, push-token rotation, and *staging* the new weights on
every plugin engine in parallel (streamed and verified into its buffers while it keeps serving);
the new version's checkpoint is written meanwhile. Then, per replica (mode "rolling"): take it
out of routing, drain (in-flight == 0, bounded wait), apply the staged weights (or reload a
checkpoint for engines without the plugin), reset its prefix cache, verify (health + version +
optional eval), re-admit. Replicas swap together when every tier keeps a routable replica of
its own meanwhile (a tier whose only replica is out borrows the others, so the fleet keeps at
least one). Mode "all_at_once" stages, then takes every replica out at once while the fleet
holds new requests (a fleet with `hold`/`release`, the gateway's: they wait rather than fail),
drains, applies on all in parallel, verifies, re-admits and releases; over bare engines it
pauses them instead (`/pause?mode=wait`), applies, resets caches and resumes. Any failure
restores the previous version from the on-disk checkpoint on every replica this rollout
touched, then raises RolloutFailed(reason).

What each replica serves is recorded in the store's `WeightHistory` (keyed by replica URL; a
rollout whose fleet records under its own names passes `record_history=False`, as the gateway
does). `rollback()` follows it: each replica goes back to the version it served before its
current one, skipping versions that were rolled back or whose rollout failed.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import httpx
import msgspec

from yieldgate.trainer_bridge.checkpoint import CheckpointStore
from yieldgate.trainer_bridge.config import BridgeConfig
from yieldgate.trainer_bridge.engine_client import EngineClient, tls_context
from yieldgate.trainer_bridge.history import Ending
from yieldgate.trainer_bridge.errors import BridgeError, EngineRequestError, PushFailed, RolloutFailed
from yieldgate.trainer_bridge.push import (
    ModelLike,
    _weights,
    apply_staged,
    discard_staged,
    make_push_token,
    push,
    reload_from_checkpoint,
    stage,
)
from yieldgate.trainer_bridge.weights import WeightSet

log = logging.getLogger(__name__)

Evaluate = Callable[[str], Awaitable[bool]]  # replica URL -> passes?


@runtime_checkable
class Fleet(Protocol):
    """What a rollout needs from whoever routes traffic. A replica is its engine base URL."""

    def replicas(self) -> Sequence[str]: ...

    async def set_routable(self, replica: str, routable: bool) -> None: ...

    async def inflight(self, replica: str) -> int: ...


def swap_waves(replicas: Sequence[str], tier_of: Callable[[str], str]) -> list[list[str]]:
    """Group replicas into waves that swap together. A wave may take out several replicas of a
    tier as long as one of them stays routable; a tier with a single replica borrows the others
    while it is out, so at most one such tier is out at a time and something always stays."""
    size = {t: sum(tier_of(x) == t for x in replicas) for t in map(tier_of, replicas)}

    def allowed(out: set[str]) -> bool:
        left = [x for x in replicas if x not in out]
        lone = {tier_of(x) for x in out if size[tier_of(x)] == 1}
        shared_ok = all(
            any(tier_of(x) == tier_of(r) for x in left) for r in out if size[tier_of(r)] > 1
        )
        return bool(left) and len(lone) <= 1 and shared_ok

    pending = list(replicas)
    waves: list[list[str]] = []
    while pending:
        wave = [pending[0]]  # always progresses, even for a fleet of one
        for r in pending[1:]:
            if allowed(set(wave) | {r}):
                wave.append(r)
        waves.append(wave)
        pending = [r for r in pending if r not in wave]
    return waves


class EngineFleet:
    """A `Fleet` over bare engine URLs: routing is a local set, in-flight comes from each
    engine's /metrics. Enough for scripts and tests; the gateway supplies its own."""

    _RUNNING = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\}\s+([0-9.e+]+)", re.M)

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.routable = set(self.urls)

    def replicas(self) -> Sequence[str]:
        return list(self.urls)

    async def set_routable(self, replica: str, routable: bool) -> None:
        (self.routable.add if routable else self.routable.discard)(replica)

    async def inflight(self, replica: str) -> int:
        async with httpx.AsyncClient(timeout=10.0, verify=tls_context()) as http:
            text = (await http.get(replica + "/metrics")).text
        return int(sum(float(v) for v in self._RUNNING.findall(text)))


class RolloutReport(msgspec.Struct):
    version: str
    mode: str
    replicas: list[str]
    previous: dict[str, str]  # replica -> version it served before
    methods: dict[str, str]  # replica -> "push" | "reload"
    seconds: float


class Rollout:
    def __init__(
        self,
        fleet: Fleet,
        store: CheckpointStore,
        *,
        mode: Literal["rolling", "all_at_once"] = "rolling",
        evaluate: Evaluate | None = None,
        config: BridgeConfig | None = None,
        current_token: str | None = None,
        record_history: bool = True,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.mode = mode
        self.evaluate = evaluate
        self.config = config or BridgeConfig()
        self.record_history = record_history
        # The push token engines are armed with; each rollout rotates it.
        self.token = current_token
        self._backends: dict[str, str | None] = {}
        self._sessions: dict[str, str] = {}  # replica -> staged session awaiting its swap
        self._saving: asyncio.Future | None = None

    async def run(
        self, weights: ModelLike | asyncio.Future, version: str,
        staged: Mapping[str, str] | None = None,
    ) -> RolloutReport:
        """`staged`: replica -> session the trainer already streamed `weights` into (straight to
        the engines, armed with `self.token`); those replicas skip token rotation and staging.
        `weights` may then be a future (a copy still arriving): only the checkpoint waits for it,
        and a replica without a session reloads that checkpoint."""
        started = time.perf_counter()
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        if not replicas:
            raise RolloutFailed("fleet has no replicas")
        pending = weights if isinstance(weights, asyncio.Future) else None
        if pending is not None and not staged:
            raise ValueError("weights still arriving need pre-staged replicas")
        wset = WeightSet([]) if pending is not None else _weights(weights, None)
        self._sessions = {r.rstrip("/"): s for r, s in (staged or {}).items()}
        self._saving = None
        waves = swap_waves(replicas, getattr(self.fleet, "tier", lambda _r: "")) \
            if self.mode == "rolling" else []
        # The first wave drains while the preparation below runs: its in-flight requests finish
        # on the old weights meanwhile, and nothing of it is touched until both are done.
        early = {r: asyncio.ensure_future(self._take_out(r)) for r in (waves[0] if waves else [])}

        # Nothing below touches what any replica serves, so it all overlaps: rotate the token and
        # stage the weights on every plugin engine, while the N-1 checkpoints are made sure of
        # and this version is written to disk (it becomes N-1 for the next rollout).
        async def checkpoints() -> dict[str, str]:
            known = getattr(self.fleet, "weight_version", None)  # saves a round trip per engine
            found = [known(r) for r in replicas] if known is not None else await asyncio.gather(
                *(asyncio.to_thread(_version, r) for r in replicas))
            previous = dict(zip(replicas, found))
            for prev in set(previous.values()):
                await asyncio.to_thread(self._ensure_checkpoint, prev)
            async def save() -> None:
                ready = _weights(await pending, None) if pending is not None else wset
                # The versions served now stay on disk until this one is through: a failure
                # restores them from there.
                await asyncio.to_thread(self.store.save, version, ready.state_dict(),
                                        set(previous.values()))

            self._saving = asyncio.ensure_future(save())
            return previous

        prepared = await asyncio.gather(checkpoints(), self._prepare(replicas, wset),
                                        return_exceptions=True)
        for result in prepared:
            if isinstance(result, BaseException):
                await asyncio.gather(*early.values(), return_exceptions=True)
                for r in early:  # untouched: they still serve the old version
                    await self.fleet.set_routable(r, True)
                await self._drop_staged()
                served = prepared[0] if isinstance(prepared[0], dict) else {}
                await self._saved(version, keep=version in served.values())
                failure = result if isinstance(result, RolloutFailed) else \
                    RolloutFailed(f"{type(result).__name__}: {result}")
                self._mark_failed(version, failure.reason, served)
                raise failure from result
        previous, token = prepared
        for r, prev in previous.items():
            self._served(r, prev, "replaced", f"engine found serving {prev}")

        touched: list[str] = []
        methods: dict[str, str] = {}
        try:
            if self.mode == "rolling":
                for wave in waves:
                    outcomes = await asyncio.gather(
                        *(self._swap(r, wset, version, token, touched, methods, early.pop(r, None))
                          for r in wave),
                        return_exceptions=True,
                    )
                    for outcome in outcomes:
                        if isinstance(outcome, BaseException):
                            raise outcome
            elif hasattr(self.fleet, "hold"):
                await self._swap_all_held(replicas, wset, version, token, touched, methods, previous)
            else:
                await asyncio.gather(*(asyncio.to_thread(_pause, r) for r in replicas))
                touched.extend(replicas)
                try:
                    results = await asyncio.gather(
                        *(self._update(r, wset, version, token) for r in replicas)
                    )
                    methods = dict(zip(replicas, results))
                    await asyncio.gather(*(self._verify(r, version) for r in replicas))
                finally:
                    await asyncio.gather(*(asyncio.to_thread(_resume, r) for r in replicas))
                for r in replicas:
                    self._served(r, version, "superseded", f"rollout of {version}")
            await self._saved(version, keep=True)
        except RolloutFailed as exc:
            await self._abort(version, touched, previous)
            self._mark_failed(version, exc.reason, previous)
            raise RolloutFailed(exc.reason, exc.replica) from exc
        except Exception as exc:  # noqa: BLE001 - any failure means: put the old weights back
            await self._abort(version, touched, previous)
            self._mark_failed(version, f"{type(exc).__name__}: {exc}", previous)
            raise RolloutFailed(f"{type(exc).__name__}: {exc}", touched[-1] if touched else None) from exc
        if self.record_history:
            self.store.history.clear([version])  # served on purpose again: no longer skipped
        return RolloutReport(version, self.mode, replicas, previous, methods, time.perf_counter() - started)

    async def _prepare(self, replicas: list[str], wset: WeightSet) -> str:
        """Rotate the push token on every plugin engine, then stage `wset` on them (in parallel,
        one serialization). -> the new token. Replicas the trainer staged keep the current token."""
        if self._sessions:
            self._backends = {r: "yieldgate" for r in self._sessions}
            assert self.token is not None, "pre-staged replicas are armed with the current token"
            return self.token
        token = await self._rotate_token(replicas)
        targets = self._stage_targets(replicas)
        if targets:
            try:
                sessions, seconds = await asyncio.to_thread(stage, wset, targets, token, self.config)
            except PushFailed as exc:
                url, cause = next(iter(exc.failures.items()))
                raise RolloutFailed(f"staging failed: {type(cause).__name__}: {cause}", url) from exc
            self._sessions = sessions
            self._note("staged", detail=f"{wset.total_bytes} bytes on {len(targets)} engine(s), "
                                        f"verified in {seconds:.2f}s")
        return token

    def _stage_targets(self, replicas: list[str]) -> list[str]:
        return [r for r in replicas if self._backends.get(r) == "yieldgate"]

    async def _swap(self, replica: str, wset: WeightSet, version: str, token: str,
                    touched: list[str], methods: dict[str, str],
                    drained: asyncio.Future | None = None) -> None:
        try:
            await (drained if drained is not None else self._take_out(replica))
        except BaseException:
            await self.fleet.set_routable(replica, True)  # untouched: it still serves the old version
            raise
        touched.append(replica)
        methods[replica] = await self._update(replica, wset, version, token)
        await self._verify(replica, version)
        await self.fleet.set_routable(replica, True)
        self._served(replica, version, "superseded", f"rollout of {version}")

    async def _swap_all(self, replicas: list[str], wset: WeightSet, version: str, token: str,
                        touched: list[str], methods: dict[str, str]) -> None:
        drains = await asyncio.gather(*(self._take_out(r) for r in replicas), return_exceptions=True)
        failed = next((d for d in drains if isinstance(d, BaseException)), None)
        if failed is not None:
            for r in replicas:  # untouched: they still serve the old version
                await self.fleet.set_routable(r, True)
            raise failed
        touched.extend(replicas)
        # Every update ends (or fails) before a failure is raised: the restore must not race one.
        results = await asyncio.gather(*(self._update(r, wset, version, token) for r in replicas),
                                       return_exceptions=True)
        for replica, result in zip(replicas, results):
            if isinstance(result, Exception) and not isinstance(result, RolloutFailed):
                raise RolloutFailed(f"{type(result).__name__}: {result}", replica) from result
            if isinstance(result, BaseException):
                raise result
        methods.update(zip(replicas, results))
        await asyncio.gather(*(self._verify(r, version) for r in replicas))
        for r in replicas:
            await self.fleet.set_routable(r, True)
            self._served(r, version, "superseded", f"rollout of {version}")

    async def _swap_all_held(self, replicas: list[str], wset: WeightSet, version: str, token: str,
                             touched: list[str], methods: dict[str, str],
                             previous: dict[str, str]) -> None:
        """`_swap_all` while the fleet holds new requests (they wait, none fails): one drain for
        every replica, not one per wave. Held requests go once every replica serves the new
        weights, or, after a failure, once the old ones are back (restored here, so `touched`
        is emptied for the caller's abort)."""
        self.fleet.hold()  # type: ignore[attr-defined]
        self._note("hold", detail="new requests wait while every replica swaps")
        try:
            await self._swap_all(replicas, wset, version, token, touched, methods)
        except BaseException:
            await self._restore(touched, previous)
            touched.clear()
            raise
        finally:
            self.fleet.release()  # type: ignore[attr-defined]
            self._note("released")

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
            self._note("checkpointed", detail=f"{self.store.versions()}")
        else:
            await asyncio.gather(saving, return_exceptions=True)
            await asyncio.to_thread(self.store.discard, version)

    async def _drop_staged(self) -> None:
        sessions, self._sessions = self._sessions, {}
        await asyncio.gather(*(asyncio.to_thread(_quietly, discard_staged, r) for r in sessions),
                             return_exceptions=True)

    def _note(self, event: str, replica: str = "", detail: str = "") -> None:
        """Timeline hook (the gateway records these)."""

    async def rollback(self, to_version: str | None = None) -> dict[str, str]:
        """Put every replica back on what it served before its current version (the history
        skips versions rolled back or failed), or on `to_version`, one replica at a time (out of
        routing and drained first). The versions left are marked rolled back.
        -> replica -> the version it serves now."""
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        known = getattr(self.fleet, "weight_version", None)
        found = [known(r) for r in replicas] if known is not None else await asyncio.gather(
            *(asyncio.to_thread(_version, r) for r in replicas))
        current = dict(zip(replicas, found))
        for r, version in current.items():
            self._served(r, version, "replaced", f"engine found serving {version}")
        targets = self.rollback_targets(replicas, to_version)
        for r in replicas:
            if current[r] != targets[r]:
                self.store.history.mark(current[r], "rolled_back", f"rolled back to {targets[r]}")
        self.store.history.clear(set(targets.values()))
        for r in replicas:
            try:
                await self._take_out(r)
            except BaseException:
                await self.fleet.set_routable(r, True)  # untouched: it still serves its version
                raise
            await self._restore([r], targets, ending="rolled_back")
        return targets

    def rollback_targets(self, replicas: Sequence[str], to_version: str | None = None) -> dict[str, str]:
        """What `rollback` would put each replica on; raises RolloutFailed if one has nothing."""
        if to_version is not None:
            if self.store.source(to_version) is None:
                raise RolloutFailed(f"no checkpoint for version {to_version!r} to roll back to")
            return {r: to_version for r in replicas}
        targets = {r: self.store.rollback_target(r) for r in replicas}
        stuck = [r for r, t in targets.items() if t is None]
        if stuck:
            raise RolloutFailed(f"nothing to roll back to for {stuck}: no earlier version that was "
                                f"neither rolled back nor failed is stored ({self.store.versions()})")
        return {r: str(t) for r, t in targets.items()}

    # --- steps
    async def _take_out(self, replica: str) -> None:
        await self.fleet.set_routable(replica, False)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (n := await self.fleet.inflight(replica)) > 0:
            if time.monotonic() > deadline:
                raise RolloutFailed(f"drain timed out with {n} request(s) in flight", replica)
            await asyncio.sleep(0.02)

    async def _update(self, replica: str, wset: WeightSet, version: str, token: str) -> str:
        session = self._sessions.pop(replica, None)
        if session is not None:
            await asyncio.to_thread(apply_staged, replica, session, version, self.config)
            return "push"
        if self._backends.get(replica) == "yieldgate":
            await asyncio.to_thread(
                push, wset, version, [replica], token=token, init=False, progress=False,
                config=self.config,
            )
            return "push"
        if self._saving is not None:
            await asyncio.shield(self._saving)  # the reload reads the checkpoint being written
        await asyncio.to_thread(reload_from_checkpoint, replica, self.store.path(version), version)
        return "reload"

    async def _verify(self, replica: str, version: str) -> str:
        """-> the version the engine reports (== `version`)."""
        client = EngineClient(replica, self.config.verify_timeout_s)
        try:
            healthy, served = await asyncio.gather(
                asyncio.to_thread(client.healthy), asyncio.to_thread(client.weight_version)
            )
        finally:
            client.close()
        if not healthy:
            raise RolloutFailed("engine unhealthy after update", replica)
        if served != version:
            raise RolloutFailed(f"engine reports version {served!r}, expected {version!r}", replica)
        if self.evaluate is not None and not await self.evaluate(replica):
            raise RolloutFailed("evaluation callback rejected the new weights", replica)
        return served

    async def _abort(self, version: str, touched: list[str], previous: dict[str, str]) -> None:
        await self._drop_staged()
        await self._restore(touched, previous)
        await self._saved(version, keep=version in previous.values())

    async def _restore(self, replicas: list[str], previous: dict[str, str],
                       ending: Literal["failed", "rolled_back"] = "failed") -> None:
        """Reload `previous[r]` on each replica and re-admit it; the version it leaves ended with
        `ending` (a rollout's failure, or a rollback)."""
        for replica in replicas:
            prev = previous[replica]
            source = self.store.source(prev)
            if source is None:
                log.error("rollback of %s to %s impossible: no checkpoint on disk", replica, prev)
                continue  # leave it out of routing: it serves unknown weights
            try:
                # Out of routing and drained first: a request spanning the reload would be
                # answered by one version and labelled with the other.
                await self._take_out(replica)
            except RolloutFailed as exc:
                log.error("restoring %s: %s; reloading anyway", replica, exc.reason)
            try:
                await asyncio.to_thread(reload_from_checkpoint, replica, source, prev)
            except (BridgeError, httpx.HTTPError, ValueError) as exc:
                log.error("rollback of %s to %s failed: %s", replica, prev, exc)
                continue  # leave it out of routing: it serves unknown weights
            await self.fleet.set_routable(replica, True)
            self._served(replica, prev, ending)

    def _served(self, replica: str, version: str, ending: Ending, reason: str = "") -> None:
        """History: `replica` serves `version` from now on (its previous stint ended `ending`)."""
        if self.record_history:
            self.store.history.observe(replica, version, ending, reason)

    def _mark_failed(self, version: str, reason: str, previous: Mapping[str, str]) -> None:
        """A failed rollout's version is skipped by later rollbacks, unless it is what some
        replica served before (a re-push of the served version failed: that version is fine)."""
        if self.record_history and version not in previous.values():
            self.store.history.mark(version, "failed", reason)

    async def _rotate_token(self, replicas: list[str]) -> str:
        token = make_push_token()
        self._backends = await rotate_push_token(replicas, token, self.token)
        self.token = token
        self._note("armed", detail="push token rotated on every engine")
        return token

    def _ensure_checkpoint(self, version: str) -> None:
        if self.store.has(version):
            return
        if version == "default":
            # "default" is what vLLM reports before any update: the weights it launched with.
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
        try:
            await asyncio.to_thread(_arm, replica, token, current)
            return "yieldgate"
        except EngineRequestError:
            backend = await asyncio.to_thread(_backend, replica)
            if backend == "yieldgate":
                raise
            return backend

    results = await asyncio.gather(*(arm(r) for r in replicas), return_exceptions=True)
    backends = {r: b for r, b in zip(replicas, results) if not isinstance(b, BaseException)}
    failed = [(r, e) for r, e in zip(replicas, results) if isinstance(e, BaseException)]
    if failed:
        armed = [r for r, b in backends.items() if b == "yieldgate"]
        if current:
            await asyncio.gather(*(asyncio.to_thread(_quietly, _arm, r, current, token) for r in armed))
        replica, exc = failed[0]
        raise RolloutFailed(f"arming failed: {type(exc).__name__}: {exc}", replica) from exc
    return backends


def _quietly(fn: Callable[..., object], *args: object) -> None:
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - clean-up on a failure path; the cause is already raised
        log.warning("%s%s failed: %s", getattr(fn, "__name__", fn), args[:1], exc)


def _version(url: str) -> str:
    with EngineClient(url, 30.0) as c:
        return c.weight_version()


def _backend(url: str) -> str | None:
    with EngineClient(url, 30.0) as c:
        return c.transfer_backend()


def _arm(url: str, token: str, current: str | None) -> None:
    info = {"token": token} if current is None else {"token": token, "current_token": current}
    with EngineClient(url, 60.0) as c:
        c.init_weight_transfer_engine(info)


def _pause(url: str) -> None:
    with EngineClient(url, 600.0) as c:
        c.pause("wait")


def _resume(url: str) -> None:
    with EngineClient(url, 60.0) as c:
        c.resume()


def default_store(base_model_dir: str | Path, config: BridgeConfig | None = None) -> CheckpointStore:
    import os

    cfg = config or BridgeConfig()
    root = cfg.checkpoint_root or os.path.join(
        os.environ.get("YIELDGATE_HOME") or os.path.expanduser("~/.cache/yieldgate"), "versions"
    )
    return CheckpointStore(root, base_model_dir, keep=cfg.keep_versions)
