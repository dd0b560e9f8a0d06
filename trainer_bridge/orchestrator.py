"""The weight orchestrator: the one rollout that may run, the push intakes a trainer streams
through, the engines' push token, the checkpoint store and its history, the serving dtype, and
the restore of a restarted engine's weights.

It is built from narrow parts: the serving `Fleet` (replicas, hold/release, the restore hook),
`forget_cached(name)` (the prefix index drops a replica's blocks), the served model's name and
where its launch weights are. It imports nothing from the gateway or any web framework; the
gateway's weights routes call it and map its errors (`WeightsRequestError`) to HTTP.

A push fans out when every replica runs the `yieldgate` backend: one intake per engine hands
the trainer's stream description to its engine as a *stage* (the engine pulls the chunks while
it serves), and one more intake receives a copy for the checkpoint store. Otherwise one intake
receives the weights and the rollout stages them itself. Either way staged weights are applied
to drained replicas only (`Rollout`). A rolling update whose version was named up front starts
as soon as every engine is pulling the stream; its first wave has been out of routing since
the stream began (`drain_early`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from yieldgate.serving.engine_control import EngineControl
from yieldgate.serving.fleet import Fleet, Replica
from . import wire
from .checkpoint import CheckpointStore
from .config import BridgeConfig
from .errors import (
    REFUSALS,
    InvalidWeightsRequest,
    NoSuchRollout,
    PushRefused,
    RolloutConflict,
    RolloutFailed,
)
from .fleet_control import swap_waves
from .intake import PushIntake
from .replica_fleet import ReplicaFleet, engine_label, engine_version, gateway_label
from .rollout import Rollout, rotate_push_token
from .schemas import (
    RESERVED_VERSIONS,
    Canary,
    CheckpointSource,
    PushAnnounce,
    RollbackRequest,
    RolloutState,
    WeightsRequest,
)

log = logging.getLogger("yieldgate.weights")


class WeightOrchestrator:
    """Owns the engines' push token, the checkpoint store and the one rollout that may run."""

    def __init__(self, fleet: Fleet, *, root: Path, model: str, model_dir: Callable[[], str],
                 forget_cached: Callable[[str], None], bridge: BridgeConfig | None = None) -> None:
        """`root`: where the store and the push token live; `model`: the name the engines serve
        (a canary asks for it); `model_dir()`: the launch weights (asked at the store's first
        use: the demo model may have to be generated); `forget_cached(name)`: drop a replica's
        prefix-index entries (its engine's cache is empty after a swap or a restart)."""
        self.fleet = fleet
        self.model = model
        self.model_dir = model_dir
        self.forget_cached = forget_cached
        self.bridge = bridge or BridgeConfig()
        self.root = root
        self._store: CheckpointStore | None = None
        self._engine_token: str | None = None
        self.lock = asyncio.Lock()
        self.current: RolloutState | None = None
        self.history: list[RolloutState] = []
        self.intakes: dict[str, PushIntake] = {}
        self._armed: dict[str, bool] = {}  # engine URL -> runs our backend, armed with engine_token
        self._dtype: str | None = None
        self._dtype_asked: asyncio.Future | None = None
        self._tasks: set[asyncio.Task] = set()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- state
    @property
    def store(self) -> CheckpointStore:
        if self._store is None:
            self._store = CheckpointStore(self.root / "versions", self.model_dir(),
                                          keep=self.bridge.keep_versions)
        return self._store

    @property
    def engine_token(self) -> str:
        """The token engines are armed with; kept on disk (0600) so a restarted gateway still holds
        it — an engine armed by a lost token refuses every later push."""
        if self._engine_token is None:
            path = self.root / "engine_push_token"
            if path.exists():
                self._engine_token = path.read_text().strip()
            else:
                self.root.mkdir(parents=True, exist_ok=True)
                self._engine_token = secrets.token_urlsafe(24)
                path.touch(mode=0o600)
                path.write_text(self._engine_token)
        return self._engine_token

    def _remember_token(self, token: str | None) -> None:
        if token and token != self._engine_token:
            self._engine_token = token
            (self.root / "engine_push_token").write_text(token)

    def start(self) -> None:
        self.fleet.restore = self.restore
        self._spawn(self._warm_dtype())

    async def restore(self, replica: Replica, found: str) -> None:
        """`replica` came back serving `found` instead of its labelled version (its engine
        restarted): reload the labelled version from the store before it takes traffic again.
        Raises (the fleet keeps the replica out, saying why) when the store does not hold it."""
        async with self.lock:  # after any rollout in progress, which may relabel the replica
            self._armed.pop(replica.url, None)  # a new engine process holds no push token
            found = await engine_version(replica.url)
            want = replica.weight_version
            if found == want:
                return
            source = self.store.source(engine_label(want))
            if source is None:
                raise RuntimeError(f"it served {want} before its engine restarted and the store "
                                   f"does not hold {want} (has {self.store.versions()}); push or "
                                   f"roll back to put it back in service")
            state = RolloutState(id=_rollout_id(), kind="restore", version=want, source="store",
                                 mode="rolling", tiers=[replica.tier])
            state.state = "running"
            state.note("start", replica.name, f"engine restarted serving {found}; reloading {want}")
            self.history.append(state)
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

    async def _warm_dtype(self) -> None:
        """Ask the serving dtype as soon as a replica is up, not at the first push: an engine's
        first /server_info runs vLLM's environment collection (seconds; over 10 on a busy box)."""
        while not any(r.healthy for r in self.fleet.replicas.values()):
            await asyncio.sleep(0.5)
        await self.serving_dtype()

    async def serving_dtype(self) -> str | None:
        """The dtype the engines serve in, asked once (every replica serves the same model); a
        caller arriving while it is being asked waits for that answer."""
        if self._dtype is None:
            if self._dtype_asked is None or self._dtype_asked.done():
                self._dtype_asked = self._spawn(self._ask_dtype())
            await asyncio.shield(self._dtype_asked)
        return self._dtype

    async def _ask_dtype(self) -> None:
        for r in self.fleet.replicas.values():
            if r.healthy:
                async with EngineControl(r.url, 30.0) as engine:
                    self._dtype = await engine.serving_dtype()
                return

    async def ensure_armed(self, replicas: list[Replica]) -> None:
        """Arm unarmed engines with the gateway's token (re-arming with the same token is a no-op)."""
        for r in replicas:
            async with EngineControl(r.url, 60.0) as engine:
                if await engine.transfer_backend() != "yieldgate":
                    self._armed[r.url] = False
                    continue
                await engine.arm(self.engine_token)
            self._armed[r.url] = True

    def select(self, tier: str | None) -> list[Replica]:
        tiers = self.fleet.tiers()
        if tier is not None and tier not in tiers:
            raise InvalidWeightsRequest(f"unknown tier {tier!r}; fleet has {tiers}", param="tier")
        picked = [r for r in self.fleet.replicas.values() if tier is None or r.tier == tier]
        if not any(r.healthy for r in picked):
            raise RolloutConflict("no healthy replica to update", code="no_replica")
        return [r for r in picked if r.healthy]

    def snapshot(self) -> dict[str, Any]:
        return {
            "replicas": {r.name: {"tier": r.tier, "url": r.url, "weight_version": r.weight_version,
                                  "healthy": r.healthy, "admitted": r.admitted, "inflight": r.inflight}
                         for r in self.fleet.replicas.values()},
            "rollout": self.current,
            "history": self.history[-10:],
            "versions": [gateway_label(v) for v in self.store.versions()],  # what the store holds
            # What each replica served and how it ended; what a rollback would return to now.
            "weight_history": self._weight_history(),
            "rollback_to": {name: _label_or_none(self.store.rollback_target(name))
                            for name in self.fleet.replicas},
            "dtype": self._dtype,  # the engines' serving dtype (pushes stream in it); null until known
        }

    def _weight_history(self) -> list[dict[str, Any]]:
        entries = self.store.history.describe(gateway_label)
        for entry in entries:
            # base counts as stored: the launch weights are read from the model once evicted.
            entry["stored"] = self.store.source(engine_label(entry["version"])) is not None
        return entries

    def _observe(self, replicas: list[Replica]) -> None:
        """History: what each replica serves as a rollout starts (a replica served something the
        history does not know, e.g. after an engine restart or before the first rollout)."""
        for r in replicas:
            self.store.history.observe(r.name, engine_label(r.weight_version), "replaced",
                                       f"engine found serving {r.weight_version}")

    def _mark_failed(self, state: RolloutState) -> None:
        """A rollout that failed marks its version: no later rollback returns to it (unless some
        replica serves it anyway, e.g. a re-push of the version served now failed)."""
        version = engine_label(state.version)
        if state.kind != "rollout" or not state.version:
            return
        if any(r.admitted and engine_label(r.weight_version) == version for r in self.fleet.replicas.values()):
            return
        self.store.history.mark(version, "failed", state.reason)

    def _begin(self, state: RolloutState) -> None:
        if self.current is not None and self.current.state == "running":
            raise RolloutConflict(f"rollout {self.current.id} is running", code="rollout_in_progress")
        if self.current is not None and self.current.state == "awaiting_push":
            # A push that never came must not block the fleet: the newer request replaces it.
            self._drop_push(self.current, self.intakes.get(self.current.id),
                            f"superseded by {state.id} before any push arrived", why="superseded")
        if self.current is not None:
            self.history.append(self.current)
        self.current = state

    def _drop_push(self, state: RolloutState, intake: PushIntake | None, reason: str,
                   why: str) -> None:
        """Fail a push still awaiting its trainer: nothing was applied, so nothing is restored.
        Its intake takes no more calls and a wave it drained early goes back (`why` says so)."""
        if intake is not None:
            intake.readmit_early(why)
        state.state, state.reason, state.finished_at = "failed", reason, time.time()
        state.note("failed", detail=reason)
        self._mark_failed(state)
        self.intakes.pop(state.id, None)

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- starting rollouts
    async def open_push(self, request: WeightsRequest) -> PushIntake:
        replicas = self.select(request.tier)
        state = RolloutState(id=_rollout_id(), kind="rollout", version=request.version or "",
                             source="push", mode=request.mode,
                             tiers=[request.tier] if request.tier else self.fleet.tiers(),
                             state="awaiting_push")
        self._begin(state)
        engines: dict[str, Replica] = {}
        if await self._all_armed(replicas):
            # The trainer streams to the engines with the token they hold (no arm round trip on
            # the push's path); the rollout retires it afterwards, so it serves one push.
            token = self.engine_token
            engines = {r.name: r for r in replicas}
        else:
            token = secrets.token_urlsafe(24)  # the gateway relays: this token reaches no engine
        intake = PushIntake(state, token, request, engines)
        self.intakes = {state.id: intake}  # only the newest intake takes pushes
        route = f"fan-out to {len(engines)} engine(s)" if engines else "relayed by the gateway"
        state.note("issued", detail=f"push token issued ({route}); waiting for the trainer")
        return intake

    async def _all_armed(self, replicas: list[Replica]) -> bool:
        """Do all `replicas` run the yieldgate backend, armed with the gateway's token? Probed
        (and armed) once per engine URL; an engine that refuses a push is probed again next time."""
        unknown = [r.url for r in replicas if r.url not in self._armed]
        if unknown:
            try:
                found = await rotate_push_token(unknown, self.engine_token, self.engine_token)
            except RolloutFailed as exc:
                log.warning("engines not armed (%s); pushes are relayed by the gateway", exc)
                return False
            self._armed.update({url: b == "yieldgate" for url, b in found.items()})
        return all(self._armed[r.url] for r in replicas)

    async def _retire_token(self, replicas: list[Replica]) -> None:
        """Rotate the engines off the token a trainer was handed (its push is over)."""
        token = secrets.token_urlsafe(24)
        try:
            await rotate_push_token([r.url for r in replicas], token, self.engine_token)
        except RolloutFailed as exc:  # every engine was handed back the old token
            log.warning("push token not retired: %s", exc)
            return
        self._remember_token(token)

    async def start_checkpoint(self, request: WeightsRequest) -> RolloutState:
        assert isinstance(request.source, CheckpointSource)
        path = Path(request.source.checkpoint)
        if not request.version:
            raise InvalidWeightsRequest("version is required", param="version")
        if not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
            raise InvalidWeightsRequest(f"no safetensors checkpoint in {path}", param="source")
        replicas = self.select(request.tier)
        state = RolloutState(id=_rollout_id(), kind="rollout", version=request.version,
                             source=f"checkpoint:{path}", mode=request.mode,
                             tiers=[request.tier] if request.tier else self.fleet.tiers())
        self._begin(state)

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
                self._mark_failed(state)
                return
            await self._run(state, replicas, weights, request, checkpoint=path)

        task = self._spawn(run())
        if request.wait:
            await asyncio.shield(task)
        return state

    async def _run(self, state: RolloutState, replicas: list[Replica], weights: Any,
                   request: WeightsRequest, checkpoint: Path | None = None,
                   staged: dict[str, str] | None = None) -> None:
        async with self.lock:
            state.state = "running"
            state.note("start", detail=f"{len(replicas)} replica(s), mode {request.mode}")
            self._observe(replicas)
            fleet = ReplicaFleet(replicas, state, self.fleet, self.forget_cached)
            evaluate = self._canary(request.canary, state) if request.canary else None
            rollout = Rollout(fleet, self.store, mode=request.mode, evaluate=evaluate,
                              config=self.bridge, current_token=self.engine_token,
                              label=f"rollout {state.id}")
            try:
                # run() arms or rotates every engine to a fresh token (current = ours).
                await rollout.run(weights, engine_label(state.version), staged=staged,
                                  checkpoint=checkpoint)
            except RolloutFailed as exc:
                self._fail(state, exc.reason, fleet, exc.replica)
            except Exception as exc:  # noqa: BLE001 - the state must say why, whatever broke
                log.exception("rollout %s crashed", state.id)
                self._fail(state, f"{type(exc).__name__}: {exc}", fleet, None)
            else:
                state.state = "succeeded"
                state.note("succeeded")
                self.store.history.clear([engine_label(state.version)])  # served again: fine now
            finally:
                self._remember_token(rollout.token)
                state.finished_at = time.time()

    def _fail(self, state: RolloutState, reason: str, fleet: ReplicaFleet, url: str | None) -> None:
        state.state = "failed"
        state.reason = reason
        state.failed_replica = fleet.by_url[url].name if url in fleet.by_url else ""
        state.note("failed", state.failed_replica, reason)
        log.error("rollout %s of %s failed: %s", state.id, state.version, reason)
        self._mark_failed(state)

    def _canary(self, canary: Canary, state: RolloutState):
        async def evaluate(url: str) -> bool:
            # Straight to the engine: the replica is out of routing while it is being verified.
            async with EngineControl(url, 60.0) as engine:
                text = await engine.complete(self.model, canary.prompt, canary.max_tokens)
            ok = canary.expect_substring in text
            names = {r.url: r.name for r in self.fleet.replicas.values()}
            state.note("canary", names.get(url, url), f"{'pass' if ok else 'fail'}: {text[:80]!r}")
            return ok

        return evaluate

    # -- push intake steps
    def intake(self, rollout_id: str, engine: str = "", finishing: bool = False) -> PushIntake:
        intake = self.intakes.get(rollout_id)
        # A rollout started from staging still takes the rest of its push (the gateway's copy).
        waiting = intake is not None and (
            intake.state.state == "awaiting_push"
            or (intake.finishing is not None and (finishing or not intake.finishing.done())))
        if intake is None or not waiting:
            raise NoSuchRollout(f"no rollout {rollout_id!r} waiting for a push", code="no_rollout")
        if engine and engine not in intake.engines:
            raise NoSuchRollout(f"rollout {rollout_id!r} has no engine {engine!r}", code="no_rollout")
        return intake

    def drain_early(self, intake: PushIntake) -> None:
        """Rolling: take the first wave out of routing as soon as the weights start streaming,
        so its in-flight requests finish (on the old weights) during the transfer rather than
        after it. Put back if the push never turns into a rollout (`readmit_early`). Once the
        rollout owns the wave (`finishing`), a late stream (the gateway's copy) must not take it
        out again: it may already be back in routing, with no watchdog left to re-admit it."""
        if intake.early or intake.finishing is not None or intake.request.mode != "rolling":
            return
        replicas = {r.url: r for r in self.select(intake.request.tier)}
        first = swap_waves(list(replicas), lambda url: replicas[url].tier)[0]
        intake.early = [replicas[url] for url in first]
        for r in intake.early:
            r.admitted = False
            intake.state.note("drain", r.name, f"{r.inflight} in flight; weights streaming")

        async def watchdog() -> None:
            await asyncio.sleep(self.bridge.stream_timeout_s)
            if intake.finishing is None:
                intake.readmit_early("no push finished in time")

        self._spawn(watchdog())

    async def stage_on_engine(self, intake: PushIntake, engine: str, info: dict[str, Any],
                              start: bool = False) -> None:
        """Fan-out: the engine pulls the trainer's stream into its staging buffers and verifies
        it in the background while it serves (`phase` "stage"); the rollout applies it later.
        `start`: open its update session first, on the same connection."""
        intake.require_armed()
        self.drain_early(intake)
        try:
            everyone = await intake.stage(engine, info, start)
        except PushRefused:
            # E.g. restarted unarmed: the next push probes and arms it.
            self._armed.pop(intake.engines[engine].url, None)
            raise
        if everyone:
            if intake.request.mode == "rolling" and intake.state.version and intake.finishing is None:
                # Every engine is pulling the stream and the version is named: start now rather
                # than at the trainer's finish. The first wave (out since the stream began) is
                # applied at once and loads each tensor as its chunks verify; an engine whose
                # stream fails fails that apply, which restores N-1. All-at-once still waits for
                # the finish: its hold must not span the transfer.
                self.start_rollout(intake, None)

    async def receive(self, intake: PushIntake, info: dict[str, Any]) -> None:
        """The gateway's copy of the push (the checkpoint store's; the only receiver when the
        gateway relays)."""
        intake.require_armed()
        staging = intake.staging_area(info)
        self.drain_early(intake)
        await intake.receive(info, staging)

    def awaiting(self, mode: str, version: str | None) -> PushIntake | None:
        """The open push a trainer's call takes up: the newest intake, still waiting for its
        push, for the same mode and version (an admin may have opened it with a canary)."""
        intake = next(iter(self.intakes.values()), None)
        if (intake is None or intake.state is not self.current
                or intake.state.state != "awaiting_push" or intake.request.mode != mode
                or intake.request.version != version):
            return None
        return intake

    async def announce(self, spec: PushAnnounce) -> tuple[PushIntake, dict[str, str]]:
        """Start a push whose stream the trainer already serves: every fan-out engine opens its
        update session and stages from the stream, and the gateway's copy starts receiving.
        -> (intake, receiver -> session: "" is the gateway's copy, else the replica name).
        The admin credential of the call stands in for the push token's init. Raises if an
        engine refused; the push is then failed and any early-drained wave re-admitted."""
        intake = self.awaiting(spec.mode, spec.version) or await self.open_push(
            WeightsRequest(version=spec.version, mode=spec.mode, tier=spec.tier))
        intake.armed = True
        info = msgspec.to_builtins(spec.stream)
        sessions = {name: os.urandom(wire.SESSION_BYTES).hex() for name in ("", *intake.engines)}
        self._spawn(self._receive_copy(intake, {**info, "session": sessions[""]}))
        outcomes = await asyncio.gather(
            *(self.stage_on_engine(intake, name, {**info, "session": sessions[name]}, start=True)
              for name in intake.engines),
            return_exceptions=True)
        failed = [(name, exc) for name, exc in zip(intake.engines, outcomes)
                  if isinstance(exc, BaseException)]
        if failed:
            for name, exc in failed:
                intake.stage_failure(name, f"{type(exc).__name__}: {exc}")
            if intake.state.state == "awaiting_push":  # the trainer gives up on this push
                self._drop_push(intake.state, intake, f"staging failed: {intake.stage_failed}",
                                why="push refused")
            else:
                intake.readmit_early("push refused")
            raise failed[0][1]
        return intake, sessions

    async def _receive_copy(self, intake: PushIntake, info: dict[str, Any]) -> None:
        """The gateway's own copy of an announced push (what the intake's update call does)."""
        try:
            await self.receive(intake, info)
        except Exception as exc:  # noqa: BLE001 - the trainer's stream reports it; the rollout's checkpoint fails
            intake.state.note("push_failed", "", f"{type(exc).__name__}: {exc}")
            intake.readmit_early("push failed")

    async def finish(self, intake: PushIntake, version: str | None) -> RolloutState:
        """Start the rollout of what was pushed, unless staging already started it. With a
        fan-out the trainer finishes every intake (one per engine, plus the gateway's); the
        first call starts it, all wait for it."""
        state = intake.state
        if intake.engines and intake.finishing is None:
            # The trainer finishes each intake as soon as its own stream is verified; the rollout
            # needs every engine staged, not the gateway's checkpoint copy (saved when it lands).
            try:
                await asyncio.wait_for(intake.engines_staged.wait(), self.bridge.stream_timeout_s)
            except TimeoutError:
                intake.stage_failed = intake.stage_failed or "engines did not stage in time"
        elif not intake.engines and intake.finishing is None and intake.staged is None:
            # Relayed and announced: the trainer's stream to the copy may have ended a moment
            # before the copy's receive task stored it.
            try:
                await asyncio.wait_for(asyncio.shield(intake.copy), self.bridge.stream_timeout_s)
            except Exception:  # noqa: BLE001 - start_rollout says that nothing verified arrived
                pass
        if intake.finishing is None:
            self.start_rollout(intake, version)
        else:
            _check_pushed_version(state, version)
        await asyncio.shield(intake.finishing)
        return state

    def start_rollout(self, intake: PushIntake, version: str | None) -> None:
        """Turn the push into a rollout (`intake.finishing`); raises InvalidWeightsRequest if it cannot be."""
        state = intake.state
        try:
            if intake.stage_failed:
                raise InvalidWeightsRequest(f"staging failed: {intake.stage_failed}")
            if intake.staged is None and not intake.engines:
                raise InvalidWeightsRequest("no verified weights staged: /update_weights first")
            _check_pushed_version(state, version)
            state.version = state.version or version or ""
            if not state.version or state.version in RESERVED_VERSIONS:
                raise InvalidWeightsRequest("a push needs a version name (not 'base' or 'default')")
            replicas = self.select(intake.request.tier)
        except InvalidWeightsRequest:
            intake.readmit_early("push refused")
            raise
        # The rollout drains its own first wave; only that wave may already be out, and from
        # now on it is the rollout's: a late push failure must not re-admit it mid-swap.
        urls = {r.url: r for r in replicas}
        first = swap_waves(list(urls), lambda url: urls[url].tier)[0] \
            if intake.request.mode == "rolling" else []
        intake.readmit_early("not in the first wave", keep=frozenset(first))
        intake.early = []
        state.state = "running"
        staged = intake.sessions or None
        weights = intake.staged if intake.staged is not None else intake.copy

        async def roll() -> None:
            await self._run(state, replicas, weights, intake.request, staged=staged)
            if staged:
                async with self.lock:
                    await self._retire_token(replicas)

        intake.finishing = self._spawn(roll())
        # Late finish calls still find the intake; the weights it holds are on disk by now.
        intake.finishing.add_done_callback(lambda _t: setattr(intake, "staged", None))

    # -- rollback
    async def rollback(self, request: RollbackRequest) -> tuple[RolloutState, dict[str, Any]]:
        """-> (the rollback's state, how its targets were chosen). Without `to`, each replica goes
        back to what it served before (the history skips versions rolled back or failed)."""
        replicas = self.select(request.tier)
        store = self.store
        named = request.to or request.to_version
        self._observe(replicas)
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
        state = RolloutState(id=_rollout_id(), kind="rollback",
                             version=labels.pop() if len(labels) == 1 else "per-replica",
                             source="store", mode="rolling",
                             tiers=[request.tier] if request.tier else self.fleet.tiers())
        self._begin(state)
        answer: dict[str, Any] = {
            "chosen_by": "request" if named else "history",
            "targets": {r.name: gateway_label(targets[r.url]) for r in replicas}}
        if named:
            mark = store.history.marked(engine_label(named))
            if mark is not None:
                answer["notice"] = (f"{named} had been marked {mark.mark} ({mark.reason}); "
                                    f"served again because the request named it")
        async with self.lock:
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
                self._fail(state, reason, fleet, url)
                # A replica left half-done stays out of routing; healthy ones come back.
                for url_, rep in fleet.by_url.items():
                    if not rep.admitted and rep.name != state.failed_replica:
                        await fleet.set_routable(url_, True)
            else:
                state.state = "succeeded"
                state.note("succeeded")
            state.finished_at = time.time()
        return state, answer

    # -- the intake routes' steps
    def arm_intake(self, rollout_id: str, engine: str, token: str) -> None:
        """The trainer's init: it must present the push token (fan-out engines were armed with
        it when the intake opened)."""
        intake = self.intake(rollout_id, engine)
        if not token or not hmac.compare_digest(token.encode(), intake.token.encode()):
            raise PushRefused("wrong push token for this rollout")
        intake.armed = True

    async def update(self, intake: PushIntake, engine: str, body: bytes) -> None:
        """The trainer's /update_weights (its JSON body): an engine stages its stream, or the
        gateway's copy receives it. A failure fails that receiver and puts an early-drained
        wave back."""
        try:
            info = msgspec.json.decode(body or b"{}")["update_info"]
            if engine:
                await self.stage_on_engine(intake, engine, info)
            else:
                await self.receive(intake, info)
        except (*REFUSALS, KeyError, ValueError, TypeError) as exc:
            intake.stage_failure(engine, f"{type(exc).__name__}: {exc}")
            intake.readmit_early("push refused")
            raise
        except Exception as exc:  # checksum / transfer: reported to the trainer
            intake.state.note("push_failed", engine, f"{type(exc).__name__}: {exc}")
            intake.stage_failure(engine, f"{type(exc).__name__}: {exc}")
            intake.readmit_early("push failed")
            raise

    async def engine_server_info(self, rollout_id: str, engine: str) -> httpx.Response:
        """An engine's /server_info for the trainer (push() reads the serving dtype there);
        every replica serves the same model."""
        intake = self.intake(rollout_id, engine)
        url = intake.engines[engine].url if engine else next(iter(self.fleet.replicas.values())).url
        async with EngineControl(url, 60.0) as control:
            return await control.server_info()


def _label_or_none(version: str | None) -> str | None:
    return gateway_label(version) if version is not None else None


def _check_pushed_version(state: RolloutState, version: str | None) -> None:
    """The version a trainer names at finish must be the one its rollout was opened for."""
    if state.version and version and version != state.version:
        raise InvalidWeightsRequest(f"pushed version {version!r} != requested {state.version!r}",
                             param="weight_version")


def _rollout_id() -> str:
    return "ro_" + secrets.token_hex(6)
