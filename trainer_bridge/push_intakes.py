"""A trainer's push, from its first call to its rollout: opening the push intake, staging on
the engines or receiving the gateway's copy, and turning what arrived into a rollout.

A push fans out when every replica runs the `yieldgate` backend: one intake per engine hands
the trainer's stream description to its engine as a *stage* (the engine pulls the chunks while
it serves), and one more receives a copy for the checkpoint store. Otherwise the gateway's copy
is the only receiver and the rollout stages it itself. Staged weights are applied to drained
replicas only. A rolling update whose version was named up front starts as soon as every engine
is pulling the stream; its first wave has been out of routing since the stream began.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import secrets
from typing import Any

import httpx
import msgspec

from yieldgate.serving import EngineControl, Fleet, Replica
from . import wire
from .background import BackgroundTasks
from .config import BridgeConfig
from .engine_arming import EngineArming
from .errors import REFUSALS, InvalidWeightsRequest, NoSuchRollout, PushRefused
from .fleet_control import swap_waves
from .intake import PushIntake
from .replica_fleet import replicas_to_update
from .rollout_book import RolloutBook, rollout_id
from .schemas import RESERVED_VERSIONS, PushAnnounce, RolloutState, WeightsRequest
from .weight_rollouts import WeightRollouts


class PushIntakes:
    def __init__(self, fleet: Fleet, book: RolloutBook, rollouts: WeightRollouts,
                 arming: EngineArming, tasks: BackgroundTasks, bridge: BridgeConfig) -> None:
        self.fleet = fleet
        self.book = book
        self.rollouts = rollouts
        self.arming = arming
        self.tasks = tasks
        self.bridge = bridge

    async def open(self, request: WeightsRequest) -> PushIntake:
        """A rollout awaiting its push, and the intake the trainer pushes to."""
        replicas = replicas_to_update(self.fleet, request.tier)
        state = RolloutState(id=rollout_id(), kind="rollout", version=request.version or "",
                             source="push", mode=request.mode,
                             tiers=[request.tier] if request.tier else self.fleet.tiers(),
                             state="awaiting_push")
        self.book.begin(state)
        engines: dict[str, Replica] = {}
        if await self.arming.all_armed(replicas):
            # The trainer streams to the engines with the token they hold (no arm round trip on
            # the push's path); the rollout retires it afterwards, so it serves one push.
            token = self.arming.token
            engines = {r.name: r for r in replicas}
        else:
            token = secrets.token_urlsafe(24)  # the gateway relays: this token reaches no engine
        intake = PushIntake(state, token, request, engines)
        self.book.intake = intake
        route = f"fan-out to {len(engines)} engine(s)" if engines else "relayed by the gateway"
        state.note("issued", detail=f"push token issued ({route}); waiting for the trainer")
        return intake

    def find(self, rollout_id: str, engine: str = "", finishing: bool = False) -> PushIntake:
        """The intake a trainer's call names; raises NoSuchRollout when it takes no more calls."""
        intake = self.book.intake
        if intake is not None and intake.state.id != rollout_id:
            intake = None
        # A rollout started from staging still takes the rest of its push (the gateway's copy).
        waiting = intake is not None and (
            intake.state.state == "awaiting_push"
            or (intake.finishing is not None and (finishing or not intake.finishing.done())))
        if intake is None or not waiting:
            raise NoSuchRollout(f"no rollout {rollout_id!r} waiting for a push", code="no_rollout")
        if engine and engine not in intake.engines:
            raise NoSuchRollout(f"rollout {rollout_id!r} has no engine {engine!r}", code="no_rollout")
        return intake

    def awaiting(self, mode: str, version: str | None) -> PushIntake | None:
        """The open push a trainer's call takes up: the newest intake, still waiting for its
        push, for the same mode and version (an admin may have opened it with a canary)."""
        intake = self.book.intake
        if (intake is None or intake.state is not self.book.current
                or intake.state.state != "awaiting_push" or intake.request.mode != mode
                or intake.request.version != version):
            return None
        return intake

    def drain_early(self, intake: PushIntake) -> None:
        """Rolling: take the first wave out of routing as soon as the weights start streaming,
        so its in-flight requests finish (on the old weights) during the transfer rather than
        after it. Put back if the push never turns into a rollout (`readmit_early`). Once the
        rollout owns the wave (`finishing`), a late stream (the gateway's copy) must not take it
        out again: it may already be back in routing, with no watchdog left to re-admit it."""
        if intake.early or intake.finishing is not None or intake.request.mode != "rolling":
            return
        replicas = {r.url: r for r in replicas_to_update(self.fleet, intake.request.tier)}
        first = swap_waves(list(replicas), lambda url: replicas[url].tier)[0]
        intake.early = [replicas[url] for url in first]
        for r in intake.early:
            r.admitted = False
            intake.state.note("drain", r.name, f"{r.inflight} in flight; weights streaming")

        async def watchdog() -> None:
            await asyncio.sleep(self.bridge.stream_timeout_s)
            if intake.finishing is None:
                intake.readmit_early("no push finished in time")

        self.tasks.spawn(watchdog())

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
            self.arming.forget(intake.engines[engine].url)
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

    async def announce(self, spec: PushAnnounce) -> tuple[PushIntake, dict[str, str]]:
        """Start a push whose stream the trainer already serves: every fan-out engine opens its
        update session and stages from the stream, and the gateway's copy starts receiving.
        -> (intake, receiver -> session: "" is the gateway's copy, else the replica name).
        The admin credential of the call stands in for the push token's init. Raises if an
        engine refused; the push is then failed and any early-drained wave re-admitted."""
        intake = self.awaiting(spec.mode, spec.version) or await self.open(
            WeightsRequest(version=spec.version, mode=spec.mode, tier=spec.tier))
        intake.armed = True
        info = msgspec.to_builtins(spec.stream)
        sessions = {name: os.urandom(wire.SESSION_BYTES).hex() for name in ("", *intake.engines)}
        self.tasks.spawn(self._receive_copy(intake, {**info, "session": sessions[""]}))
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
                self.book.drop_push(intake.state, f"staging failed: {intake.stage_failed}",
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
            replicas = replicas_to_update(self.fleet, intake.request.tier)
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
            await self.rollouts.run(state, replicas, weights, intake.request, staged=staged)
            if staged:
                async with self.book.lock:
                    await self.arming.retire(replicas)

        intake.finishing = self.tasks.spawn(roll())
        # Late finish calls still find the intake; the weights it holds are on disk by now.
        intake.finishing.add_done_callback(lambda _t: setattr(intake, "staged", None))

    def arm(self, rollout_id: str, engine: str, token: str) -> None:
        """The trainer's init: it must present the push token (fan-out engines were armed with
        it when the intake opened)."""
        intake = self.find(rollout_id, engine)
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
        intake = self.find(rollout_id, engine)
        url = intake.engines[engine].url if engine else next(iter(self.fleet.replicas.values())).url
        async with EngineControl(url, 60.0) as control:
            return await control.server_info()


def _check_pushed_version(state: RolloutState, version: str | None) -> None:
    """The version a trainer names at finish must be the one its rollout was opened for."""
    if state.version and version and version != state.version:
        raise InvalidWeightsRequest(f"pushed version {version!r} != requested {state.version!r}",
                             param="weight_version")
