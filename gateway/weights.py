"""Weight rollouts orchestrated by the gateway: the admin API over trainer_bridge's `Rollout`.

    POST /admin/weights            start a rollout (source "push" or {"checkpoint": PATH})
    GET  /admin/weights            per-replica versions + the current/last rollout and its timeline
    POST /admin/weights/rollback   every replica back to what it served before, rolling, in one
                                   call ({"to": V} names any stored version instead)
    POST /admin/weights/push       announce a push whose stream is ready: every receiver starts
                                   pulling it (what `trainer_bridge.push(gateway=URL)` calls)
    GET  /admin/weight_targets     the engine-shaped intakes to push to, one call at a time

A trainer's push goes through the gateway, never around it: the gateway exposes engine-shaped
intakes (`/weights/intake/<id>/...`, the same four weight-sync calls vLLM serves). When every
replica runs the `yieldgate` backend, the push fans out: one intake per engine forwards the
trainer's stream description to its engine as a *stage* (the engine pulls the chunks straight
from the trainer while it serves), and one more intake receives a copy for the checkpoint
store (rollback needs it on disk). The trainer serializes once and streams to all of them in
parallel; the gateway only orchestrates. Otherwise one intake receives the weights and the
rollout stages them on the engines itself. Either way the staged weights are then applied to
drained replicas only: one wave at a time ("rolling"), or all at once while the gateway holds
new requests ("all_at_once": they wait in `Fleet.wait_released`, then are routed, and labelled,
on the new weights); no engine's live weights change while it serves. The rollout starts once
every engine has staged; the gateway's checkpoint copy may still be arriving. A rolling update
whose version was named up front (`weight_targets?version=`, as push() does) starts as soon as
every engine is pulling the stream: its first wave, out of routing since the stream began,
loads each tensor as its chunks verify. `?direct=1`
lists the real engines and their push token instead, for trainers that manage engines
themselves.

`POST /admin/weights/push` is the same push in one trainer round trip instead of four (targets,
init, start, update, each through a gateway that a busy 2-core host leaves unscheduled for
tens to hundreds of ms): the trainer opens its chunk server first and sends the stream
description with the announce; the gateway picks a session per receiver, opens and stages every
engine and starts its copy, and answers with the sessions and the push token the chunks are
signed with. The trainer then streams and calls the intake's finish, as before.

Versions: vLLM reports "default" before any update; the gateway labels that "base".
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
from typing import TYPE_CHECKING, Annotated, Any, Literal

import httpx
import msgspec
from fastapi import APIRouter, Request
from msgspec import Meta
from starlette.responses import Response

from yieldgate.serving.config import home_dir
from yieldgate.serving.fleet import BASE_VERSION, ENGINE_BASE_VERSION, Fleet as ServingFleet, Replica
from yieldgate.trainer_bridge import (
    BridgeConfig,
    CheckpointStore,
    EngineClient,
    EngineRequestError,
    PushRefused,
    RolloutFailed,
    WeightHistory,
    reload_from_checkpoint,
    wire,
)
from yieldgate.trainer_bridge.engine_client import tls_context
from yieldgate.trainer_bridge.receiver import ParamLayout, StagingArea, receive_update_async
from yieldgate.trainer_bridge.rollout import Rollout, rotate_push_token, swap_waves
from yieldgate.trainer_bridge.weights import WeightSet

from .http import decode_body, json_response
from .errors import APIError, InvalidRequest, NotFound

if TYPE_CHECKING:
    from .app import Gateway

log = logging.getLogger("yieldgate.weights")

_Version = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
RESERVED_VERSIONS = (BASE_VERSION, ENGINE_BASE_VERSION)


class Conflict(APIError):
    status = 409


# -- wire schemas ---------------------------------------------------------------------------------

class Canary(msgspec.Struct, forbid_unknown_fields=True):
    """A greedy completion each updated replica must pass before it is re-admitted."""

    prompt: Annotated[str, Meta(min_length=1, max_length=8192)]
    expect_substring: str
    max_tokens: Annotated[int, Meta(ge=1, le=256)] = 16


class CheckpointSource(msgspec.Struct, forbid_unknown_fields=True):
    checkpoint: str


class WeightsRequest(msgspec.Struct, forbid_unknown_fields=True):
    version: _Version | None = None         # required for a checkpoint; a push may name it at finish
    source: Literal["push"] | CheckpointSource = "push"
    mode: Literal["rolling", "all_at_once"] = "rolling"
    tier: str | None = None                 # None = every tier
    canary: Canary | None = None
    wait: bool = False                      # checkpoint: answer only once the rollout ended


class PushStream(msgspec.Struct, forbid_unknown_fields=True):
    """What a trainer streams and where from: the update info every receiver of the push gets,
    less the session (one per receiver, chosen by the gateway)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sender: Annotated[str, Meta(min_length=3, max_length=300)]  # "host:port" of its chunk server
    checksum: str = "crc32"
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    extra: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        if self.checksum not in wire.CHECKSUMS:
            raise ValueError(f"unsupported checksum {self.checksum!r}")


class PushAnnounce(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /admin/weights/push`: open (or take up) a push and start every receiver pulling the
    trainer's stream, in one round trip instead of targets + init + start + update."""

    version: _Version
    stream: PushStream
    mode: Literal["rolling", "all_at_once"] = "rolling"
    tier: str | None = None


class RollbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    to: _Version | None = None              # None = what each replica served before (history)
    to_version: _Version | None = None      # older spelling of `to`
    tier: str | None = None


class TimelineEvent(msgspec.Struct):
    t: float                                # unix seconds
    event: str                              # issued, pushed, drain, updated, admitted, failed, ...
    replica: str = ""
    detail: str = ""


class RolloutState(msgspec.Struct):
    id: str
    kind: Literal["rollout", "rollback", "restore"]  # restore: a restarted engine gets its weights back
    version: str
    source: str                             # "push" | "checkpoint:<path>" | "store"
    mode: str
    tiers: list[str]
    state: Literal["awaiting_push", "running", "succeeded", "failed"] = "running"
    reason: str = ""
    failed_replica: str = ""
    started_at: float = msgspec.field(default_factory=time.time)
    finished_at: float | None = None
    timeline: list[TimelineEvent] = []

    def note(self, event: str, replica: str = "", detail: str = "") -> None:
        self.timeline.append(TimelineEvent(time.time(), event, replica, detail))


# -- the gateway fleet as trainer_bridge's Fleet ---------------------------------------------------

def gateway_label(engine_version: str) -> str:
    return BASE_VERSION if engine_version == ENGINE_BASE_VERSION else engine_version


def engine_label(version: str) -> str:
    return ENGINE_BASE_VERSION if version == BASE_VERSION else version


class RolloutFleet:
    """trainer_bridge's `Fleet` over gateway replicas: routable -> `admitted`, in-flight -> the
    gateway's own count (a drained replica has no request of ours left on it)."""

    def __init__(self, replicas: list[Replica], state: RolloutState,
                 serving: ServingFleet | None = None, history: WeightHistory | None = None,
                 forget_cached: Callable[[str], None] | None = None) -> None:
        self.by_url = {r.url: r for r in replicas}
        self.state = state
        self.serving = serving
        self.history = history
        self.verified: dict[str, str] = {}  # url -> engine version read by the rollout's verify
        # Engines whose weights this rollout touched: their prefix cache was reset with the swap,
        # so the prefix index forgets their blocks before they serve again (`forget_cached(name)`).
        self.touched: set[str] = set()
        self.forget_cached = forget_cached

    def replicas(self) -> list[str]:
        return list(self.by_url)

    def tier(self, replica: str) -> str:
        return self.by_url[replica].tier

    def weight_version(self, replica: str) -> str:
        """The engine's version as last read or verified (the label every response carries)."""
        return engine_label(self.by_url[replica].weight_version)

    def hold(self) -> None:
        if self.serving is not None:
            self.serving.hold()

    def release(self) -> None:
        if self.serving is not None:
            self.serving.release()

    async def set_routable(self, replica: str, routable: bool) -> None:
        r = self.by_url[replica]
        if routable:
            if replica in self.touched and self.forget_cached is not None:
                self.touched.discard(replica)
                # Without KV events the index would keep predicting hits on the reset cache.
                self.forget_cached(r.name)
            # Label first, admit second: every response from now on names the weights that made it.
            if replica in self.verified:
                r.label_weights(gateway_label(self.verified.pop(replica)))
            else:
                await self.sync_version(replica)
            r.admitted, r.note = True, ""
            self.state.note("admitted", r.name, r.weight_version)
            self._record(r)
        else:
            r.admitted = False
            self.state.note("drain", r.name, f"{r.inflight} in flight")

    def _record(self, r: Replica) -> None:
        """History: `r` serves its (new) label now; how its previous version's stint ended."""
        if self.history is None:
            return
        version = engine_label(r.weight_version)
        if self.state.kind == "rollback":
            ending, reason = "rolled_back", f"rollback {self.state.id}"
        elif version == engine_label(self.state.version):
            ending, reason = "superseded", f"rollout {self.state.id}"
        else:  # restored after the rollout of state.version failed; _fail adds the reason
            ending, reason = "failed", ""
        self.history.observe(r.name, version, ending, reason)

    async def inflight(self, replica: str) -> int:
        return self.by_url[replica].inflight

    async def sync_version(self, replica: str) -> None:
        version = await asyncio.to_thread(_engine_version, replica)
        self.by_url[replica].label_weights(gateway_label(version))


def _engine_version(url: str) -> str:
    with EngineClient(url, 30.0) as client:
        return client.weight_version()


class GatewayRollout(Rollout):
    """`Rollout` with the gateway's hooks: a timeline, version labels set as soon as an engine
    verifies (all-at-once resumes engines before `run` returns), and checkpoint reloads."""

    def __init__(self, fleet: RolloutFleet, store: CheckpointStore, state: RolloutState, *,
                 checkpoint: Path | None = None, **kwargs: Any) -> None:
        # The fleet records the history under replica names (RolloutFleet._record).
        super().__init__(fleet, store, record_history=False, **kwargs)
        self.rfleet = fleet
        self.state = state
        self.checkpoint = checkpoint

    async def _update(self, replica: str, wset: WeightSet, version: str, token: str) -> str:
        name = self.rfleet.by_url[replica].name
        self.rfleet.touched.add(replica)
        self.state.note("update", name)
        if self.checkpoint is not None:
            await asyncio.to_thread(reload_from_checkpoint, replica, self.checkpoint, version)
            method = "reload"
        else:
            method = await super()._update(replica, wset, version, token)
        self.state.note("updated", name, method)
        return method

    def _note(self, event: str, replica: str = "", detail: str = "") -> None:
        name = self.rfleet.by_url[replica].name if replica in self.rfleet.by_url else replica
        self.state.note(event, name, detail)

    async def _restore(self, replicas: list[str], previous: dict[str, str], **kw: Any) -> None:
        self.rfleet.verified.clear()  # restored replicas are labelled from the engine again
        self.rfleet.touched.update(replicas)
        await super()._restore(replicas, previous, **kw)

    def _stage_targets(self, replicas: list[str]) -> list[str]:
        # A checkpoint rollout reloads from disk; only pushed weights are staged over the wire.
        return [] if self.checkpoint is not None else super()._stage_targets(replicas)

    async def _verify(self, replica: str, version: str) -> str:
        served = await super()._verify(replica, version)
        self.rfleet.verified[replica] = served
        self.rfleet.by_url[replica].label_weights(gateway_label(served))
        self.state.note("verified", self.rfleet.by_url[replica].name, gateway_label(version))
        return served


# -- push intake: the gateway plays one engine for the trainer -------------------------------------

class PushIntake:
    """Stages one pushed weight set. Authenticated by the per-rollout push token: init must
    present it, and every streamed chunk carries an HMAC made with it."""

    def __init__(self, state: RolloutState, token: str, request: WeightsRequest,
                 engines: dict[str, Replica] | None = None) -> None:
        self.state = state
        self.token = token
        self.request = request
        self.armed = False
        self.staged: dict[str, Any] | None = None  # the gateway's copy (checkpoint, fallbacks)
        # Fan-out: replica name -> replica the trainer streams to directly (armed with `token`),
        # and engine URL -> the session each one staged.
        self.engines = engines or {}
        self.sessions: dict[str, str] = {}
        self.finishing: asyncio.Task | None = None  # the rollout every finish call waits on
        self.early: list[Replica] = []  # the rolling update's first wave, out of routing early
        loop = asyncio.get_running_loop()
        # The gateway's own copy (for the checkpoint store). With a fan-out the rollout does not
        # wait for it: the engines verified their own copies, and rollback needs only N-1 on disk.
        self.copy: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.copy.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        self.engines_staged = asyncio.Event()  # every fan-out engine staged, or one failed
        self.stage_failed = ""


class WeightOrchestrator:
    """Owns the engines' push token, the checkpoint store and the one rollout that may run."""

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw
        self.fleet: ServingFleet = gw.fleet
        self.bridge = BridgeConfig()
        self.root = home_dir() / "weights"
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
            model_dir = self.gw.config.fleet.model_path
            if not model_dir:
                from yieldgate.serving.demo_model import ensure_demo_model
                model_dir = str(ensure_demo_model(spec=self.gw.config.fleet.demo_model))
            self._store = CheckpointStore(self.root / "versions", model_dir, keep=self.bridge.keep_versions)
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
            found = gateway_label(await asyncio.to_thread(_engine_version, replica.url))
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
            await asyncio.to_thread(reload_from_checkpoint, replica.url, source, engine_label(want))
            served = gateway_label(await asyncio.to_thread(_engine_version, replica.url))
            if served != want:
                state.state, state.reason = "failed", f"engine reports {served} after reloading {want}"
                raise RuntimeError(state.reason)
            replica.label_weights(want)
            replica.note = ""
            self.gw.routing.forget_cached(replica.name)  # the new process's KV cache is empty
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
                with EngineClient(r.url, 30.0) as client:
                    dtype = await asyncio.to_thread(client.model_dtype)
                self._dtype = wire.dtype_name(dtype) if dtype is not None else None
                return

    async def ensure_armed(self, replicas: list[Replica]) -> None:
        """Arm unarmed engines with the gateway's token (re-arming with the same token is a no-op)."""
        for r in replicas:
            if await asyncio.to_thread(_backend, r.url) != "yieldgate":
                self._armed[r.url] = False
                continue
            with EngineClient(r.url, 60.0) as client:
                await asyncio.to_thread(client.init_weight_transfer_engine, {"token": self.engine_token})
            self._armed[r.url] = True

    def select(self, tier: str | None) -> list[Replica]:
        tiers = self.fleet.tiers()
        if tier is not None and tier not in tiers:
            raise InvalidRequest(f"unknown tier {tier!r}; fleet has {tiers}", param="tier")
        picked = [r for r in self.fleet.replicas.values() if tier is None or r.tier == tier]
        if not any(r.healthy for r in picked):
            raise Conflict("no healthy replica to update", code="no_replica")
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
            raise Conflict(f"rollout {self.current.id} is running", code="rollout_in_progress")
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
            self.readmit_early(intake, why)
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
            raise InvalidRequest("version is required", param="version")
        if not (path / "model.safetensors").exists() and not list(path.glob("*.safetensors")):
            raise InvalidRequest(f"no safetensors checkpoint in {path}", param="source")
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
            fleet = RolloutFleet(replicas, state, self.fleet, self.store.history,
                                 forget_cached=self.gw.routing.forget_cached)
            evaluate = self._canary(request.canary, state) if request.canary else None
            rollout = GatewayRollout(fleet, self.store, state, checkpoint=checkpoint, mode=request.mode,
                                     evaluate=evaluate, config=self.bridge,
                                     current_token=self.engine_token)
            try:
                # run() arms or rotates every engine to a fresh token (current = ours).
                await rollout.run(weights, engine_label(state.version), staged=staged)
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

    def _fail(self, state: RolloutState, reason: str, fleet: RolloutFleet, url: str | None) -> None:
        state.state = "failed"
        state.reason = reason
        state.failed_replica = fleet.by_url[url].name if url in fleet.by_url else ""
        state.note("failed", state.failed_replica, reason)
        log.error("rollout %s of %s failed: %s", state.id, state.version, reason)
        self._mark_failed(state)

    def _canary(self, canary: Canary, state: RolloutState):
        model = self.gw.config.fleet.model

        async def evaluate(url: str) -> bool:
            # Straight to the engine: the replica is out of routing while it is being verified.
            async with httpx.AsyncClient(timeout=60.0, verify=tls_context()) as http:
                resp = await http.post(url + "/v1/completions", json={
                    "model": model, "prompt": canary.prompt, "max_tokens": canary.max_tokens,
                    "temperature": 0})
            text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else ""
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
            raise NotFound(f"no rollout {rollout_id!r} waiting for a push", code="no_rollout")
        if engine and engine not in intake.engines:
            raise NotFound(f"rollout {rollout_id!r} has no engine {engine!r}", code="no_rollout")
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
                self.readmit_early(intake, "no push finished in time")

        self._spawn(watchdog())

    def readmit_early(self, intake: PushIntake, why: str, keep: frozenset[str] = frozenset()) -> None:
        early, intake.early = intake.early, [r for r in intake.early if r.url in keep]
        for r in early:
            if r.url not in keep and not r.admitted:
                r.admitted = True  # untouched: it still serves the weights it is labelled with
                intake.state.note("admitted", r.name, f"{r.weight_version} ({why})")

    async def start_on_engine(self, intake: PushIntake, engine: str) -> None:
        """Open the engine's update session (vLLM refuses /update_weights outside one). A session
        an abandoned push left open is ended first: nothing staged in it was ever applied."""
        if not intake.armed:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with the push token")
        with EngineClient(intake.engines[engine].url, 60.0) as client:
            await asyncio.to_thread(_start_session, client)

    async def stage_on_engine(self, intake: PushIntake, engine: str, info: dict[str, Any],
                              start: bool = False) -> None:
        """Fan-out: the engine pulls the trainer's stream into its staging buffers and verifies
        it in the background while it serves (`phase` "stage"); the rollout applies it later.
        `start`: open its update session first (`start_on_engine`), on the same connection."""
        if not intake.armed:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with the push token")
        url = intake.engines[engine].url
        self.drain_early(intake)
        with EngineClient(url, 60.0) as client:
            def stage() -> None:
                if start:
                    _start_session(client)
                client.update_weights({**info, "phase": "stage"})

            try:
                await asyncio.to_thread(stage)
            except PushRefused:
                self._armed.pop(url, None)  # e.g. restarted unarmed: the next push probes and arms it
                raise
        intake.sessions[url] = str(info["session"])
        intake.state.note("staging", engine, "the engine pulls the trainer's stream while it serves")
        if len(intake.sessions) == len(intake.engines):
            intake.engines_staged.set()
            if intake.request.mode == "rolling" and intake.state.version and intake.finishing is None:
                # Every engine is pulling the stream and the version is named: start now rather
                # than at the trainer's finish. The first wave (out since the stream began) is
                # applied at once and loads each tensor as its chunks verify; an engine whose
                # stream fails fails that apply, which restores N-1. All-at-once still waits for
                # the finish: its hold must not span the transfer.
                self.start_rollout(intake, None)

    async def receive(self, intake: PushIntake, info: dict[str, Any]) -> None:
        if not intake.armed:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with the push token")
        layout = [ParamLayout(n, wire.parse_dtype(d), tuple(s))
                  for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)]
        staging = StagingArea(layout)
        self.drain_early(intake)
        t0 = time.perf_counter()
        try:
            await receive_update_async(info["sender"], bytes.fromhex(info["session"]), intake.token,
                                       staging, info.get("checksum", "crc32"),
                                       float(info.get("timeout_s", 60.0)))
        except BaseException as exc:
            if not intake.copy.done():
                intake.copy.set_exception(exc)
            raise
        intake.staged = dict(staging.items())
        if not intake.copy.done():
            intake.copy.set_result(intake.staged)
        intake.state.note("pushed", detail=f"{staging.total_bytes} bytes verified in "
                                           f"{time.perf_counter() - t0:.2f}s")

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
                self.stage_failure(intake, name, f"{type(exc).__name__}: {exc}")
            if intake.state.state == "awaiting_push":  # the trainer gives up on this push
                self._drop_push(intake.state, intake, f"staging failed: {intake.stage_failed}",
                                why="push refused")
            else:
                self.readmit_early(intake, "push refused")
            raise failed[0][1]
        return intake, sessions

    async def _receive_copy(self, intake: PushIntake, info: dict[str, Any]) -> None:
        """The gateway's own copy of an announced push (what the intake's update call does)."""
        try:
            await self.receive(intake, info)
        except Exception as exc:  # noqa: BLE001 - the trainer's stream reports it; the rollout's checkpoint fails
            intake.state.note("push_failed", "", f"{type(exc).__name__}: {exc}")
            self.readmit_early(intake, "push failed")

    def stage_failure(self, intake: PushIntake, engine: str, reason: str) -> None:
        """A fan-out engine did not stage: a finish call waiting for the others gives up."""
        if engine:
            intake.stage_failed = intake.stage_failed or f"{engine}: {reason}"
            intake.engines_staged.set()

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
        """Turn the push into a rollout (`intake.finishing`); raises APIError if it cannot be."""
        state = intake.state
        try:
            if intake.stage_failed:
                raise InvalidRequest(f"staging failed: {intake.stage_failed}")
            if intake.staged is None and not intake.engines:
                raise InvalidRequest("no verified weights staged: /update_weights first")
            _check_pushed_version(state, version)
            state.version = state.version or version or ""
            if not state.version or state.version in RESERVED_VERSIONS:
                raise InvalidRequest("a push needs a version name (not 'base' or 'default')")
            replicas = self.select(intake.request.tier)
        except APIError:
            self.readmit_early(intake, "push refused")
            raise
        # The rollout drains its own first wave; only that wave may already be out, and from
        # now on it is the rollout's: a late push failure must not re-admit it mid-swap.
        urls = {r.url: r for r in replicas}
        first = swap_waves(list(urls), lambda url: urls[url].tier)[0] \
            if intake.request.mode == "rolling" else []
        self.readmit_early(intake, "not in the first wave", keep=frozenset(first))
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
                raise Conflict(f"no checkpoint of {named!r} (have {store.versions()})", code="no_checkpoint")
        else:
            found = {r.url: store.rollback_target(r.name) for r in replicas}
            if None in found.values():
                stuck = [r.name for r in replicas if found[r.url] is None]
                raise Conflict(f"nothing to roll back to for {stuck}: no earlier version that was "
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
            fleet = RolloutFleet(replicas, state, history=store.history,
                                 forget_cached=self.gw.routing.forget_cached)
            rollout = GatewayRollout(fleet, store, state, checkpoint=None, config=self.bridge)
            state.note("start", detail=f"back to {state.version} ({answer['chosen_by']})"
                                       + (f"; {answer['notice']}" if "notice" in answer else ""))
            # The versions left are marked now: the operator judged them bad, even if this fails.
            for r in replicas:
                left = engine_label(r.weight_version)
                if left != targets[r.url]:
                    store.history.mark(left, "rolled_back", f"rollback {state.id}")
            store.history.clear(set(targets.values()))
            try:
                for r in replicas:
                    # Same steps as a rolling update, from the stored checkpoint.
                    target = targets[r.url]
                    rollout.checkpoint = store.source(target)
                    await rollout._take_out(r.url)
                    await rollout._update(r.url, WeightSet([]), target, "")
                    await rollout._verify(r.url, target)
                    await fleet.set_routable(r.url, True)
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


def _label_or_none(version: str | None) -> str | None:
    return gateway_label(version) if version is not None else None


def _check_pushed_version(state: RolloutState, version: str | None) -> None:
    """The version a trainer names at finish must be the one its rollout was opened for."""
    if state.version and version and version != state.version:
        raise InvalidRequest(f"pushed version {version!r} != requested {state.version!r}",
                             param="weight_version")


def _rollout_id() -> str:
    return "ro_" + secrets.token_hex(6)


def _backend(url: str) -> str | None:
    with EngineClient(url, 30.0) as client:
        return client.transfer_backend()


def _start_session(client: EngineClient) -> None:
    """Open the engine's update session; one an abandoned push left open is ended first."""
    try:
        client.start_weight_update()
    except EngineRequestError as exc:
        if "already active" not in str(exc):
            raise
        client.finish_weight_update()
        client.start_weight_update()


# -- routes ----------------------------------------------------------------------------------------

def _engine_error(exc: Exception) -> Response:
    # EngineClient (the trainer side) recognises a refusal by these words in the error text.
    status = 403 if isinstance(exc, PushRefused) else 400
    return json_response({"error": {"message": f"{type(exc).__name__}: {exc}",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "push_refused" if status == 403 else "push_failed"}}, status)


def build_weights_admin_routes(router: APIRouter, gw: "Gateway") -> None:
    """Mount the admin half on the (admin-authenticated) /admin router."""
    orch: WeightOrchestrator = gw.weights

    @router.get("/weights")
    async def weights_status() -> Response:
        return json_response(orch.snapshot())

    @router.post("/weights")
    async def weights_start(request: Request) -> Response:
        spec: WeightsRequest = await decode_body(request, WeightsRequest)
        if spec.version in RESERVED_VERSIONS:
            raise InvalidRequest(f"version {spec.version!r} is reserved", param="version")
        if spec.source == "push":
            intake = await orch.open_push(spec)
            return json_response({"rollout": intake.state, **_targets(request, intake)}, 202)
        state = await orch.start_checkpoint(spec)
        return json_response({"rollout": state}, 200 if spec.wait else 202)

    @router.post("/weights/rollback")
    async def weights_rollback(request: Request) -> Response:
        spec: RollbackRequest = await decode_body(request, RollbackRequest)
        state, answer = await orch.rollback(spec)
        return json_response({"rollout": state, **answer}, 200 if state.state == "succeeded" else 500)

    @router.post("/weights/push")
    async def weights_push(request: Request) -> Response:
        spec: PushAnnounce = await decode_body(request, PushAnnounce)
        if spec.version in RESERVED_VERSIONS:
            raise InvalidRequest(f"version {spec.version!r} is reserved", param="version")
        try:
            intake, sessions = await orch.announce(spec)
        except APIError:
            raise
        except Exception as exc:  # noqa: BLE001 - an engine refused or failed: the trainer's error
            return _engine_error(exc)
        base = _targets(request, intake)["engines"][0]
        return json_response({
            "rollout": intake.state.id, "push_token": intake.token,
            "targets": [{"url": base + (f"/engine/{name}" if name else ""), "session": session}
                        for name, session in sessions.items()],
            "finish": base + "/finish_weight_update"})

    @router.get("/weight_targets")
    async def weight_targets(request: Request, direct: bool = False, tier: str | None = None,
                             mode: str = "rolling", version: str | None = None) -> Response:
        if direct:
            replicas = orch.select(tier)
            await orch.ensure_armed(replicas)
            return json_response({"engines": [r.url for r in replicas], "push_token": orch.engine_token})
        # Naming the version here (push() does) lets a rolling update start as soon as every
        # engine is staging, instead of at the trainer's finish.
        try:
            spec = msgspec.convert({"tier": tier, "mode": mode, "version": version}, WeightsRequest)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid weight_targets query: {exc}") from None
        if spec.version in RESERVED_VERSIONS:
            raise InvalidRequest(f"version {spec.version!r} is reserved", param="version")
        intake = orch.awaiting(spec.mode, spec.version) or await orch.open_push(spec)
        return json_response({**_targets(request, intake), "rollout": intake.state.id,
                              "dtype": await orch.serving_dtype()})


def _targets(request: Request, intake: PushIntake) -> dict[str, Any]:
    base = f"{str(request.base_url).rstrip('/')}/weights/intake/{intake.state.id}"
    # The gateway's own intake first: push() asks the first target for the serving dtype.
    engines = [base] + [f"{base}/engine/{name}" for name in intake.engines]
    return {"engines": engines, "push_token": intake.token}


def build_intake_router(gw: "Gateway") -> APIRouter:
    """The engine-shaped push intakes. No admin credential: the push token authenticates.

    `/weights/intake/<id>/...` receives into the gateway; `/weights/intake/<id>/engine/<name>/...`
    (fan-out) hands the stream to that engine. Both serve the same calls."""
    orch: WeightOrchestrator = gw.weights
    router = APIRouter(prefix="/weights/intake/{rollout_id}", include_in_schema=False)

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            return msgspec.json.decode(raw or b"{}")
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"invalid JSON: {exc}") from None

    async def health(rollout_id: str, engine: str = "") -> Response:
        orch.intake(rollout_id, engine)
        return Response(status_code=200)

    async def server_info(rollout_id: str, engine: str = "") -> Response:
        # push() asks for the serving dtype; every replica serves the same model.
        intake = orch.intake(rollout_id, engine)
        url = intake.engines[engine].url if engine else next(iter(orch.fleet.replicas.values())).url
        async with httpx.AsyncClient(timeout=60.0, verify=tls_context()) as http:  # see model_dtype
            resp = await http.get(url + "/server_info")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def init(rollout_id: str, request: Request, engine: str = "") -> Response:
        intake = orch.intake(rollout_id, engine)
        token = str((await body(request)).get("init_info", {}).get("token") or "")
        if not token or not hmac.compare_digest(token.encode(), intake.token.encode()):
            return _engine_error(PushRefused("wrong push token for this rollout"))
        intake.armed = True  # fan-out engines were armed with this token when the intake opened
        return json_response({"status": "ok"})

    async def start(rollout_id: str, engine: str = "") -> Response:
        intake = orch.intake(rollout_id, engine)
        if engine:
            try:
                await orch.start_on_engine(intake, engine)
            except Exception as exc:  # noqa: BLE001 - reported to the trainer
                return _engine_error(exc)
        return json_response({"status": "ok"})

    async def update(rollout_id: str, request: Request, engine: str = "") -> Response:
        intake = orch.intake(rollout_id, engine)
        try:
            info = (await body(request))["update_info"]
            if engine:
                await orch.stage_on_engine(intake, engine, info)
            else:
                await orch.receive(intake, info)
        except (PushRefused, KeyError, ValueError, TypeError) as exc:
            orch.stage_failure(intake, engine, f"{type(exc).__name__}: {exc}")
            orch.readmit_early(intake, "push refused")
            return _engine_error(exc)
        except Exception as exc:  # noqa: BLE001 - checksum / transfer: reported to the trainer
            intake.state.note("push_failed", engine, f"{type(exc).__name__}: {exc}")
            orch.stage_failure(intake, engine, f"{type(exc).__name__}: {exc}")
            orch.readmit_early(intake, "push failed")
            return _engine_error(exc)
        return json_response({"status": "ok"})

    async def finish(rollout_id: str, request: Request, engine: str = "") -> Response:
        intake = orch.intake(rollout_id, engine, finishing=True)
        state = await orch.finish(intake, (await body(request)).get("weight_version"))
        if state.state != "succeeded":
            return json_response({"error": {"message": f"rollout failed: {state.reason}",
                                            "type": "server_error", "param": None,
                                            "code": "rollout_failed"}}, 500)
        return json_response({"status": "ok", "rollout": state})

    async def reset(rollout_id: str, engine: str = "") -> Response:
        # Each engine's cache was reset when its update landed; nothing is left to do.
        return json_response({"success": True})

    async def weight_info(rollout_id: str, engine: str = "") -> Response:
        return json_response({"weight_version": orch.current.version if orch.current else ""})

    for prefix in ("", "/engine/{engine}"):
        router.add_api_route(prefix + "/health", health, methods=["GET"])
        router.add_api_route(prefix + "/server_info", server_info, methods=["GET"])
        router.add_api_route(prefix + "/init_weight_transfer_engine", init, methods=["POST"])
        router.add_api_route(prefix + "/start_weight_update", start, methods=["POST"])
        router.add_api_route(prefix + "/update_weights", update, methods=["POST"])
        router.add_api_route(prefix + "/finish_weight_update", finish, methods=["POST"])
        router.add_api_route(prefix + "/reset_prefix_cache", reset, methods=["POST"])
        router.add_api_route(prefix + "/weight_info", weight_info, methods=["GET"])
    return router
