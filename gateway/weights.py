"""The weights admin API and the engine-shaped push intakes: routes over trainer_bridge's
`WeightOrchestrator`, and the mapping of its errors to HTTP. What they do: docs/weights.md.

    POST /admin/weights            start a rollout (source "push" or {"checkpoint": PATH})
    GET  /admin/weights            per-replica versions + the current/last rollout and its timeline
    POST /admin/weights/rollback   every replica back to what it served before, rolling, in one
                                   call ({"to": V} names any stored version instead)
    POST /admin/weights/push       announce a push whose stream is ready: every receiver starts
                                   pulling it (what `trainer_bridge.push(gateway=URL)` calls)
    GET  /admin/weight_targets     the engine-shaped intakes to push to, one call at a time
                                   (`?direct=1`: the real engines and their push token)
    /weights/intake/<id>/...       the four weight-sync calls vLLM serves, for trainers written
                                   against vLLM's own API (no admin credential: the push token)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from yieldgate.serving import Fleet, home_dir
from yieldgate.trainer_bridge.intake import PushIntake
from yieldgate.trainer_bridge.orchestrator import WeightOrchestrator
from yieldgate.trainer_bridge.push_intakes import PushIntakes
from yieldgate.trainer_bridge.errors import (
    REFUSALS,
    InvalidWeightsRequest,
    NoSuchRollout,
    RolloutConflict,
    WeightsRequestError,
)
from yieldgate.trainer_bridge.replica_fleet import replicas_to_update
from yieldgate.trainer_bridge.schemas import RESERVED_VERSIONS, PushAnnounce, RollbackRequest, WeightsRequest

from .errors import APIError, InvalidRequest, NotFound
from .http import decode_body, json_response



class Conflict(APIError):
    status = 409


_HTTP_ERRORS: dict[type[WeightsRequestError], type[APIError]] = {
    InvalidWeightsRequest: InvalidRequest,
    RolloutConflict: Conflict,
    NoSuchRollout: NotFound,
}


@contextmanager
def _as_http() -> Iterator[None]:
    """The orchestrator's refusals as OpenAI-shaped errors with their status."""
    try:
        yield
    except WeightsRequestError as exc:
        raise _HTTP_ERRORS.get(type(exc), InvalidRequest)(exc.message, param=exc.param,
                                                          code=exc.code) from None


def weight_orchestrator(fleet: Fleet, forget_cached: Callable[[str], None]) -> WeightOrchestrator:
    """The orchestrator over this gateway's fleet and model; `forget_cached(replica)` when a
    replica's engine drops its prefix cache."""
    fleet_config = fleet.config

    def model_dir() -> str:
        from yieldgate.serving import ensure_model
        return str(ensure_model(fleet_config.model_path, fleet_config.demo_model))

    return WeightOrchestrator(fleet, root=home_dir() / "weights", model=fleet_config.model,
                              model_dir=model_dir, forget_cached=forget_cached)


def _engine_error(exc: Exception) -> Response:
    # EngineClient (the trainer side) recognises a refusal by these words in the error text.
    status = 403 if isinstance(exc, REFUSALS) else 400
    return json_response({"error": {"message": f"{type(exc).__name__}: {exc}",
                                    "type": "invalid_request_error", "param": None,
                                    "code": "push_refused" if status == 403 else "push_failed"}}, status)


def _check_version(version: str | None) -> None:
    if version in RESERVED_VERSIONS:
        raise InvalidRequest(f"version {version!r} is reserved", param="version")


def build_weights_admin_routes(router: APIRouter, orch: WeightOrchestrator) -> None:
    """Mount the admin half on the (admin-authenticated) /admin router."""

    @router.get("/weights")
    async def weights_status() -> Response:
        return json_response(orch.snapshot())

    @router.post("/weights")
    async def weights_start(request: Request) -> Response:
        spec: WeightsRequest = await decode_body(request, WeightsRequest)
        _check_version(spec.version)
        with _as_http():
            if spec.source == "push":
                intake = await orch.pushes.open(spec)
                return json_response({"rollout": intake.state, **_targets(request, intake)}, 202)
            state = await orch.rollouts.from_checkpoint(spec)
        return json_response({"rollout": state}, 200 if spec.wait else 202)

    @router.post("/weights/rollback")
    async def weights_rollback(request: Request) -> Response:
        spec: RollbackRequest = await decode_body(request, RollbackRequest)
        with _as_http():
            state, answer = await orch.rollouts.rollback(spec)
        return json_response({"rollout": state, **answer}, 200 if state.state == "succeeded" else 500)

    @router.post("/weights/push")
    async def weights_push(request: Request) -> Response:
        spec: PushAnnounce = await decode_body(request, PushAnnounce)
        _check_version(spec.version)
        try:
            with _as_http():
                intake, sessions = await orch.pushes.announce(spec)
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
        with _as_http():
            if direct:
                replicas = replicas_to_update(orch.fleet, tier)
                await orch.arming.ensure_armed(replicas)
                return json_response({"engines": [r.url for r in replicas],
                                      "push_token": orch.arming.token})
            # Naming the version here (push() does) lets a rolling update start as soon as every
            # engine is staging, instead of at the trainer's finish.
            try:
                spec = msgspec.convert({"tier": tier, "mode": mode, "version": version}, WeightsRequest)
            except msgspec.ValidationError as exc:
                raise InvalidRequest(f"invalid weight_targets query: {exc}") from None
            _check_version(spec.version)
            intake = orch.pushes.awaiting(spec.mode, spec.version) or await orch.pushes.open(spec)
            return json_response({**_targets(request, intake), "rollout": intake.state.id,
                                  "dtype": await orch.dtype.ask()})


def _targets(request: Request, intake: PushIntake) -> dict[str, Any]:
    base = f"{str(request.base_url).rstrip('/')}/weights/intake/{intake.state.id}"
    # The gateway's own intake first: push() asks the first target for the serving dtype.
    engines = [base] + [f"{base}/engine/{name}" for name in intake.engines]
    return {"engines": engines, "push_token": intake.token}


def build_intake_router(pushes: PushIntakes) -> APIRouter:
    """The engine-shaped push intakes. No admin credential: the push token authenticates.

    `/weights/intake/<id>/...` receives into the gateway; `/weights/intake/<id>/engine/<name>/...`
    (fan-out) hands the stream to that engine. Both serve the same calls."""
    router = APIRouter(prefix="/weights/intake/{rollout_id}", include_in_schema=False)

    async def body(request: Request) -> dict[str, Any]:
        raw = await request.body()
        try:
            return msgspec.json.decode(raw or b"{}")
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"invalid JSON: {exc}") from None

    async def health(rollout_id: str, engine: str = "") -> Response:
        with _as_http():
            pushes.find(rollout_id, engine)
        return Response(status_code=200)

    async def server_info(rollout_id: str, engine: str = "") -> Response:
        with _as_http():
            resp = await pushes.engine_server_info(rollout_id, engine)
        return Response(resp.content, status_code=resp.status_code, media_type="application/json")

    async def init(rollout_id: str, request: Request, engine: str = "") -> Response:
        token = str((await body(request)).get("init_info", {}).get("token") or "")
        try:
            with _as_http():
                pushes.arm(rollout_id, engine, token)
        except REFUSALS as exc:
            return _engine_error(exc)
        return json_response({"status": "ok"})

    async def start(rollout_id: str, engine: str = "") -> Response:
        with _as_http():
            intake = pushes.find(rollout_id, engine)
        if engine:
            try:
                await intake.open_session(engine)
            except Exception as exc:  # noqa: BLE001 - reported to the trainer
                return _engine_error(exc)
        return json_response({"status": "ok"})

    async def update(rollout_id: str, request: Request, engine: str = "") -> Response:
        with _as_http():
            intake = pushes.find(rollout_id, engine)
        try:
            await pushes.update(intake, engine, await request.body())
        except Exception as exc:  # noqa: BLE001 - refused, checksum, transfer: the trainer's error
            return _engine_error(exc)
        return json_response({"status": "ok"})

    async def finish(rollout_id: str, request: Request, engine: str = "") -> Response:
        with _as_http():
            intake = pushes.find(rollout_id, engine, finishing=True)
            state = await pushes.finish(intake, (await body(request)).get("weight_version"))
        if state.state != "succeeded":
            return json_response({"error": {"message": f"rollout failed: {state.reason}",
                                            "type": "server_error", "param": None,
                                            "code": "rollout_failed"}}, 500)
        return json_response({"status": "ok", "rollout": state})

    async def reset(rollout_id: str, engine: str = "") -> Response:
        # Each engine's cache was reset when its update landed; nothing is left to do.
        return json_response({"success": True})

    async def weight_info(rollout_id: str, engine: str = "") -> Response:
        return json_response({"weight_version": pushes.book.current.version if pushes.book.current else ""})

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
