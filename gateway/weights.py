"""Weight rollouts orchestrated by the gateway: the admin API over trainer_bridge's `Rollout`.

    POST /admin/weights            start a rollout (source "push" or {"checkpoint": PATH})
    GET  /admin/weights            per-replica versions + the current/last rollout and its timeline
    POST /admin/weights/rollback   every replica back to N-1, rolling, in one call
    GET  /admin/weight_targets     what `trainer_bridge.push(gateway=URL)` pushes to

A trainer's push goes to the gateway, not to the engines: the gateway exposes an engine-shaped
intake (`/weights/intake/<id>/...`, the same four weight-sync calls vLLM serves) that stages the
streamed weights, then rolls them through the fleet: staged on every engine in parallel while
they serve, then applied one drained replica at a time. The trainer streams once; no engine's
live weights change while it serves. `?direct=1` lists the real engines and
their push token instead, for trainers that manage engines themselves.

Versions: vLLM reports "default" before any update; the gateway labels that "base".
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import httpx
import msgspec
from fastapi import APIRouter, Request
from msgspec import Meta
from starlette.responses import Response

from serving.config import home_dir
from serving.fleet import BASE_VERSION, ENGINE_BASE_VERSION, Fleet as ServingFleet, Replica
from trainer_bridge import (
    BridgeConfig,
    CheckpointStore,
    EngineClient,
    PushRefused,
    RolloutFailed,
    reload_from_checkpoint,
    wire,
)
from trainer_bridge.engine_client import tls_context
from trainer_bridge.receiver import ParamLayout, StagingArea, receive_update
from trainer_bridge.rollout import Rollout
from trainer_bridge.weights import WeightSet

from .admin import decode_body, json_response
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


class RollbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    to_version: _Version | None = None      # None = the version before the one served now
    tier: str | None = None


class TimelineEvent(msgspec.Struct):
    t: float                                # unix seconds
    event: str                              # issued, pushed, drain, updated, admitted, failed, ...
    replica: str = ""
    detail: str = ""


class RolloutState(msgspec.Struct):
    id: str
    kind: Literal["rollout", "rollback"]
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

    def __init__(self, replicas: list[Replica], state: RolloutState) -> None:
        self.by_url = {r.url: r for r in replicas}
        self.state = state
        self.verified: dict[str, str] = {}  # url -> engine version read by the rollout's verify

    def replicas(self) -> list[str]:
        return list(self.by_url)

    def tier(self, replica: str) -> str:
        return self.by_url[replica].tier

    async def set_routable(self, replica: str, routable: bool) -> None:
        r = self.by_url[replica]
        if routable:
            # Label first, admit second: every response from now on names the weights that made it.
            if replica in self.verified:
                r.weight_version = gateway_label(self.verified.pop(replica))
            else:
                await self.sync_version(replica)
            r.admitted = True
            self.state.note("admitted", r.name, r.weight_version)
        else:
            r.admitted = False
            self.state.note("drain", r.name, f"{r.inflight} in flight")

    async def inflight(self, replica: str) -> int:
        return self.by_url[replica].inflight

    async def sync_version(self, replica: str) -> None:
        version = await asyncio.to_thread(_engine_version, replica)
        self.by_url[replica].weight_version = gateway_label(version)


def _engine_version(url: str) -> str:
    with EngineClient(url, 30.0) as client:
        return client.weight_version()


class GatewayRollout(Rollout):
    """`Rollout` with the gateway's hooks: a timeline, version labels set as soon as an engine
    verifies (all-at-once resumes engines before `run` returns), and checkpoint reloads."""

    def __init__(self, fleet: RolloutFleet, store: CheckpointStore, state: RolloutState, *,
                 checkpoint: Path | None = None, **kwargs: Any) -> None:
        super().__init__(fleet, store, **kwargs)
        self.rfleet = fleet
        self.state = state
        self.checkpoint = checkpoint

    async def _update(self, replica: str, wset: WeightSet, version: str, token: str) -> str:
        name = self.rfleet.by_url[replica].name
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

    async def _abort(self, version: str, touched: list[str], previous: dict[str, str]) -> None:
        self.rfleet.verified.clear()  # restored replicas are labelled from the engine again
        await super()._abort(version, touched, previous)

    def _stage_targets(self, replicas: list[str]) -> list[str]:
        # A checkpoint rollout reloads from disk; only pushed weights are staged over the wire.
        return [] if self.checkpoint is not None else super()._stage_targets(replicas)

    async def _verify(self, replica: str, version: str) -> str:
        served = await super()._verify(replica, version)
        self.rfleet.verified[replica] = served
        self.rfleet.by_url[replica].weight_version = gateway_label(served)
        self.state.note("verified", self.rfleet.by_url[replica].name, gateway_label(version))
        return served


# -- push intake: the gateway plays one engine for the trainer -------------------------------------

class PushIntake:
    """Stages one pushed weight set. Authenticated by the per-rollout push token: init must
    present it, and every streamed chunk carries an HMAC made with it."""

    def __init__(self, state: RolloutState, token: str, request: WeightsRequest) -> None:
        self.state = state
        self.token = token
        self.request = request
        self.armed = False
        self.staged: dict[str, Any] | None = None


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
                from serving.demo_model import ensure_demo_model
                model_dir = str(ensure_demo_model())
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

    async def ensure_armed(self, replicas: list[Replica]) -> None:
        """Arm unarmed engines with the gateway's token (re-arming with the same token is a no-op)."""
        for r in replicas:
            if await asyncio.to_thread(_backend, r.url) != "yieldgate":
                continue
            with EngineClient(r.url, 60.0) as client:
                await asyncio.to_thread(client.init_weight_transfer_engine, {"token": self.engine_token})

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
            "versions": [gateway_label(v) for v in self.store.versions()],
        }

    def _begin(self, state: RolloutState) -> None:
        if self.current is not None and self.current.state == "running":
            raise Conflict(f"rollout {self.current.id} is running", code="rollout_in_progress")
        if self.current is not None and self.current.state == "awaiting_push":
            # A push that never came must not block the fleet: the newer request replaces it.
            self.current.state = "failed"
            self.current.reason = f"superseded by {state.id} before any push arrived"
            self.current.finished_at = time.time()
            self.intakes.pop(self.current.id, None)
        if self.current is not None:
            self.history.append(self.current)
        self.current = state

    def _spawn(self, coro: Any) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- starting rollouts
    def open_push(self, request: WeightsRequest) -> PushIntake:
        self.select(request.tier)
        state = RolloutState(id=_rollout_id(), kind="rollout", version=request.version or "",
                             source="push", mode=request.mode,
                             tiers=[request.tier] if request.tier else self.fleet.tiers(),
                             state="awaiting_push")
        self._begin(state)
        intake = PushIntake(state, secrets.token_urlsafe(24), request)
        self.intakes = {state.id: intake}  # only the newest intake takes pushes
        state.note("issued", detail="push token issued; waiting for the trainer")
        return intake

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
                return
            await self._run(state, replicas, weights, request, checkpoint=path)

        task = self._spawn(run())
        if request.wait:
            await asyncio.shield(task)
        return state

    async def _run(self, state: RolloutState, replicas: list[Replica], weights: Any,
                   request: WeightsRequest, checkpoint: Path | None = None) -> None:
        async with self.lock:
            state.state = "running"
            state.note("start", detail=f"{len(replicas)} replica(s), mode {request.mode}")
            fleet = RolloutFleet(replicas, state)
            evaluate = self._canary(request.canary, state) if request.canary else None
            rollout = GatewayRollout(fleet, self.store, state, checkpoint=checkpoint, mode=request.mode,
                                     evaluate=evaluate, config=self.bridge,
                                     current_token=self.engine_token)
            try:
                # run() arms or rotates every engine to a fresh token (current = ours).
                await rollout.run(weights, engine_label(state.version))
            except RolloutFailed as exc:
                self._fail(state, exc.reason, fleet, exc.replica)
            except Exception as exc:  # noqa: BLE001 - the state must say why, whatever broke
                log.exception("rollout %s crashed", state.id)
                self._fail(state, f"{type(exc).__name__}: {exc}", fleet, None)
            else:
                state.state = "succeeded"
                state.note("succeeded")
            finally:
                self._remember_token(rollout.token)
                state.finished_at = time.time()

    def _fail(self, state: RolloutState, reason: str, fleet: RolloutFleet, url: str | None) -> None:
        state.state = "failed"
        state.reason = reason
        state.failed_replica = fleet.by_url[url].name if url in fleet.by_url else ""
        state.note("failed", state.failed_replica, reason)
        log.error("rollout %s of %s failed: %s", state.id, state.version, reason)

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
    def intake(self, rollout_id: str) -> PushIntake:
        intake = self.intakes.get(rollout_id)
        if intake is None or intake.state.state != "awaiting_push":
            raise NotFound(f"no rollout {rollout_id!r} waiting for a push", code="no_rollout")
        return intake

    async def receive(self, intake: PushIntake, info: dict[str, Any]) -> None:
        if not intake.armed:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with the push token")
        layout = [ParamLayout(n, wire.parse_dtype(d), tuple(s))
                  for n, d, s in zip(info["names"], info["dtype_names"], info["shapes"], strict=True)]
        staging = StagingArea(layout)
        t0 = time.perf_counter()
        await asyncio.to_thread(receive_update, info["sender"], bytes.fromhex(info["session"]),
                                intake.token, staging, info.get("checksum", "crc32"),
                                float(info.get("timeout_s", 60.0)))
        intake.staged = dict(staging.items())
        intake.state.note("pushed", detail=f"{staging.total_bytes} bytes verified in "
                                           f"{time.perf_counter() - t0:.2f}s")

    async def finish(self, intake: PushIntake, version: str | None) -> RolloutState:
        state = intake.state
        if intake.staged is None:
            raise InvalidRequest("no verified weights staged: /update_weights first")
        if state.version and version and version != state.version:
            raise InvalidRequest(f"pushed version {version!r} != requested {state.version!r}",
                                 param="weight_version")
        state.version = state.version or version or ""
        if not state.version or state.version in RESERVED_VERSIONS:
            raise InvalidRequest("a push needs a version name (not 'base' or 'default')")
        replicas = self.select(intake.request.tier)
        self.intakes.pop(state.id, None)
        state.state = "running"
        await self._run(state, replicas, intake.staged, intake.request)
        return state

    # -- rollback
    async def rollback(self, request: RollbackRequest) -> RolloutState:
        replicas = self.select(request.tier)
        served = {engine_label(r.weight_version) for r in replicas}
        store = self.store
        if request.to_version:
            target = engine_label(request.to_version)
        else:
            if len(served) != 1:
                raise Conflict(f"replicas serve different versions {sorted(served)}; name to_version")
            target = store.previous(served.pop()) or ""
        if target == ENGINE_BASE_VERSION and not store.has(target):
            source = store.base_model_dir  # the launch weights never leave disk, even when evicted
        elif target and store.has(target):
            source = store.path(target)
        else:
            raise Conflict(f"no checkpoint to roll back to (have {store.versions()})", code="no_checkpoint")
        state = RolloutState(id=_rollout_id(), kind="rollback", version=gateway_label(target),
                             source="store", mode="rolling",
                             tiers=[request.tier] if request.tier else self.fleet.tiers())
        self._begin(state)
        async with self.lock:
            fleet = RolloutFleet(replicas, state)
            rollout = GatewayRollout(fleet, store, state, checkpoint=source, config=self.bridge)
            state.note("start", detail=f"back to {state.version}")
            try:
                for r in replicas:
                    # Same steps as a rolling update, from the stored checkpoint.
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
        return state


def _rollout_id() -> str:
    return "ro_" + secrets.token_hex(6)


def _backend(url: str) -> str | None:
    with EngineClient(url, 30.0) as client:
        return client.transfer_backend()


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
            intake = orch.open_push(spec)
            return json_response({"rollout": intake.state, **_targets(request, intake)}, 202)
        state = await orch.start_checkpoint(spec)
        return json_response({"rollout": state}, 200 if spec.wait else 202)

    @router.post("/weights/rollback")
    async def weights_rollback(request: Request) -> Response:
        spec: RollbackRequest = await decode_body(request, RollbackRequest)
        state = await orch.rollback(spec)
        return json_response({"rollout": state}, 200 if state.state == "succeeded" else 500)

    @router.get("/weight_targets")
    async def weight_targets(request: Request, direct: bool = False, tier: str | None = None) -> Response:
        if direct:
            replicas = orch.select(tier)
            await orch.ensure_armed(replicas)
            return json_response({"engines": [r.url for r in replicas], "push_token": orch.engine_token})
        current = orch.current
        intake = next(iter(orch.intakes.values()), None)
        if intake is None or current is None or intake.state is not current:
            intake = orch.open_push(WeightsRequest(tier=tier))
        return json_response({**_targets(request, intake), "rollout": intake.state.id})


def _targets(request: Request, intake: PushIntake) -> dict[str, Any]:
    base = str(request.base_url).rstrip("/")
    return {"engines": [f"{base}/weights/intake/{intake.state.id}"], "push_token": intake.token}


def build_intake_router(gw: "Gateway") -> APIRouter:
    """The engine-shaped push intake. No admin credential: the push token authenticates."""
    orch: WeightOrchestrator = gw.weights
    router = APIRouter(prefix="/weights/intake/{rollout_id}", include_in_schema=False)

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            return msgspec.json.decode(raw or b"{}")
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"invalid JSON: {exc}") from None

    @router.get("/health")
    async def health(rollout_id: str) -> Response:
        orch.intake(rollout_id)
        return Response(status_code=200)

    @router.get("/server_info")
    async def server_info(rollout_id: str) -> Response:
        # push() asks for the serving dtype; every replica serves the same model.
        orch.intake(rollout_id)
        url = next(iter(orch.fleet.replicas.values())).url
        async with httpx.AsyncClient(timeout=10.0, verify=tls_context()) as http:
            resp = await http.get(url + "/server_info")
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    @router.post("/init_weight_transfer_engine")
    async def init(rollout_id: str, request: Request) -> Response:
        intake = orch.intake(rollout_id)
        token = str((await body(request)).get("init_info", {}).get("token") or "")
        if not token or not hmac.compare_digest(token.encode(), intake.token.encode()):
            return _engine_error(PushRefused("wrong push token for this rollout"))
        intake.armed = True
        return json_response({"status": "ok"})

    @router.post("/start_weight_update")
    async def start(rollout_id: str) -> Response:
        orch.intake(rollout_id)
        return json_response({"status": "ok"})

    @router.post("/update_weights")
    async def update(rollout_id: str, request: Request) -> Response:
        intake = orch.intake(rollout_id)
        try:
            await orch.receive(intake, (await body(request))["update_info"])
        except (PushRefused, KeyError, ValueError, TypeError) as exc:
            return _engine_error(exc)
        except Exception as exc:  # noqa: BLE001 - checksum / transfer: reported to the trainer
            intake.state.note("push_failed", detail=f"{type(exc).__name__}: {exc}")
            return _engine_error(exc)
        return json_response({"status": "ok"})

    @router.post("/finish_weight_update")
    async def finish(rollout_id: str, request: Request) -> Response:
        intake = orch.intake(rollout_id)
        state = await orch.finish(intake, (await body(request)).get("weight_version"))
        if state.state != "succeeded":
            return json_response({"error": {"message": f"rollout failed: {state.reason}",
                                            "type": "server_error", "param": None,
                                            "code": "rollout_failed"}}, 500)
        return json_response({"status": "ok", "rollout": state})

    @router.post("/reset_prefix_cache")
    async def reset(rollout_id: str) -> Response:
        # Each engine's cache was reset when its update landed; nothing is left to do.
        return json_response({"success": True})

    @router.get("/weight_info")
    async def weight_info(rollout_id: str) -> Response:
        return json_response({"weight_version": orch.current.version if orch.current else ""})

    return router
