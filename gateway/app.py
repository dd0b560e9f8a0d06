"""The gateway's ASGI app: OpenAI- and Anthropic-compatible endpoints, health, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import ipaddress
import logging
from decimal import Decimal
from typing import TYPE_CHECKING, Any, AsyncIterator

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from yieldgate.serving import Replica, Supervisor

from .accounting import Accounting
from .adapter_canary import CanaryGate, build_adapter_canary_router
from .adapter_push import build_adapter_push_router
from .adapters import build_adapters_router
from .admin import build_admin_router, build_feedback_router
from .apis import APIS, ROUTES
from .batch_api import build_batch_router
from .batch_store import BatchStore, BatchStoreUnavailable, new_id
from .batch_worker import BatchWorker
from .http import admin_only, json_response
from .config import Config
from .dashboard import Dashboard, build_dashboard_router
from .drain import Drain, DrainingServer, close_within, default_instance_id
from .errors import APIError, InternalError, ModelNotFound, error_response
from .exchange import Pipeline
from .health import build_health_router
from .message_batches import build_message_batch_router
from .openapi import install as install_openapi
from .metrics import MULTIPROCESS, GatewayMetrics
from .proxy import Proxy
from .registry import ModelPool, ModelRegistry, model_cards, open_pools
from .stall import LoopWatch
from .tracing import Tracing
from .schemas import ModelList
from .weights import build_intake_router, weight_orchestrator

if TYPE_CHECKING:
    import uvicorn

log = logging.getLogger("yieldgate.gateway")
_encode = msgspec.json.Encoder().encode
GC_YOUNG_THRESHOLD = 50_000


class InsecureConfig(RuntimeError):
    """Refusing to listen publicly without any credential."""


def check_exposure(config: Config) -> None:
    server = config.server
    try:
        loopback = ipaddress.ip_address(server.host).is_loopback
    except ValueError:
        loopback = server.host == "localhost"
    if loopback or server.allow_insecure_public:
        return
    if not server.require_keys or not server.admin_token:
        raise InsecureConfig(
            f"refusing to listen on {server.host} without API keys and an admin token; set "
            "server.require_keys and server.admin_token, or server.allow_insecure_public = true")


class Gateway:
    """Everything the app holds while it runs."""

    def __init__(self, config: Config, supervisor: Supervisor | None = None):
        self.config = config
        self.instance_id = config.server.instance_id or default_instance_id()
        self.drain = Drain()  # SIGTERM: not ready, then stop (gateway/drain.py)
        self.metrics = GatewayMetrics(self.instance_id, config.fleet.lora.metric_series)
        self.supervisor = supervisor  # the engines `yieldgate up` launched and keeps running
        self._down_reason: dict[str, str] = {}
        self._publisher: asyncio.Task | None = None
        if supervisor is not None:
            supervisor.on_event = self._engine_event
        # Every model a pool of its own (gateway/registry.py); [fleet]'s is the primary: the weight
        # pushes, adapter admin and canaries work on it.
        self.models = ModelRegistry(config, open_pools(config, self.instance_id))
        primary = self.models.primary
        self.fleet, self.routing, self.adapters = primary.fleet, primary.routing, primary.adapters
        self.accounting = Accounting(config, self.metrics, self.fleet, self.instance_id)
        self.dashboard = Dashboard(self.accounting)
        self.canary_gate = CanaryGate(self.adapters, self.accounting, config.canary)
        self.pipeline = Pipeline(config, self.models, self.accounting)
        if config.tracing.endpoint:
            self.pipeline.tracing = Tracing(config.tracing, self.instance_id)
        self.proxy = Proxy(self.pipeline, self.drain, self.instance_id)
        self.weights = weight_orchestrator(self.fleet, self.routing.forget_cached)
        # The Batch and Message Batches APIs: files and jobs in PostgreSQL, lines run by every gateway's worker.
        self.batch_store: BatchStore | None = None
        self.batch_worker: BatchWorker | None = None
        if config.server.postgres_url and config.lanes.batch:
            self.batch_store = BatchStore(config.server.postgres_url)
            self.batch_worker = BatchWorker(self.batch_store, self.pipeline, self.proxy, config.lanes,
                                            owner=new_id(f"{self.instance_id}-"))
        for pool in self.models:
            pool.fleet.discovery.on_failure = self._discovery_failed
            pool.fleet.on_join.append(self._joined_to(pool))
            pool.fleet.on_leave.append(self._left)

    async def start(self) -> None:
        self.loop_watch = LoopWatch(asyncio.get_running_loop())  # logs what holds the loop (gateway/stall.py)
        self.loop_watch.start()
        for pool in self.models:
            await pool.fleet.start()
        await self.accounting.start()
        await self.dashboard.start()
        for pool in self.models:
            await pool.start(self.config.server.redis_url)
        await self.models.start_auto(self.accounting)
        await self.canary_gate.start()
        self.pipeline.start()
        await self.proxy.start()
        self.weights.start()
        # One of several workers (gateway/workers.py): the others' scrapes read this one's counts.
        self._publisher = asyncio.create_task(self.metrics.publish_every()) if MULTIPROCESS else None
        if self.batch_store is not None and self.batch_worker is not None:
            try:
                await self.batch_store.open()
                self.batch_worker.start()
            except BatchStoreUnavailable as exc:  # the Batch API answers 503 until a restart finds it
                log.error("Batch API unavailable: %s", exc)

    async def close(self) -> None:
        """Each part in turn, the ledger among the first (its journal flushed to the store), each
        bounded in time (gateway/drain.py close_within): one part that hangs stops nothing else."""
        if self.batch_worker is not None:  # its lines in flight go back to the queue
            await close_within("batch worker", self.batch_worker.close())
        if self.batch_store is not None:
            await close_within("batch store", self.batch_store.close())
        for name, part in (("weights", self.weights), ("proxy", self.proxy), ("canary gate", self.canary_gate),
                           ("auto", self.models), ("accounting", self.accounting), ("dashboard", self.dashboard)):
            await close_within(name, part.close())
        for pool in self.models:
            await close_within(f"model {pool.name}", pool.close())
        if self._publisher is not None:  # the last counts, where the remaining workers' scrapes read them
            self._publisher.cancel()
            self.metrics.publish()
        if self.pipeline.tracing is not None:  # the spans of the last requests, exported
            await close_within("tracing", asyncio.to_thread(self.pipeline.tracing.shutdown))
        self.loop_watch.stop()

    def _engine_event(self, replica: str, event: str, detail: str) -> None:
        """From the supervisor's thread: count restarts by what brought the engine down."""
        if event in ("exited", "unhealthy"):
            self._down_reason[replica] = event
        elif event == "restarted":
            self.metrics.engine_restarts.labels(replica, self._down_reason.get(replica, "unknown")).inc()

    def _discovery_failed(self, tier: str, reason: str) -> None:
        self.metrics.discovery_failures.labels(tier, reason).inc()

    def _joined_to(self, pool: ModelPool):
        async def joined(replica: Replica) -> None:
            self.accounting.fleet_cost.add_replica(replica.name, Decimal(replica.config.cost_per_hour or "0"),
                                                   replica.tier, pool.name)
            self.metrics.membership.labels(replica.tier, "joined").inc()
        return joined

    async def _left(self, replica: Replica) -> None:
        self.metrics.membership.labels(replica.tier, "left").inc()
        for gauge, labels in ((self.metrics.replica_up, (replica.name, replica.tier)),
                              (self.metrics.inflight, (replica.name,))):
            with contextlib.suppress(KeyError):  # a replica gone before any scrape has no series
                gauge.remove(*labels)

    def engine_status(self) -> dict[str, dict[str, Any]]:
        return self.supervisor.status() if self.supervisor is not None else {}



class GatewayApp(FastAPI):
    """The FastAPI app, except that the inference routes are served straight from ASGI: no
    middleware stack, router, dependency solver, exception layers or Request object (about a tenth
    of the gateway's CPU per request). Their OpenAPI operations come from their schemas
    (gateway/openapi.py)."""

    gateway: Gateway

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        kind = ROUTES.get(scope.get("path", "")) if scope["type"] == "http" else None
        if kind is None or scope["method"] != "POST":
            await super().__call__(scope, receive, send)
            return
        gw = self.gateway
        api = APIS[kind]
        try:
            headers = dict(scope["headers"])
            key = await gw.pipeline.authenticate(kind, headers)
            response = await gw.proxy.handle(kind, scope, receive, key, headers)
        except APIError as exc:
            gw.metrics.rejections.labels(exc.code or exc.type).inc()
            response = api.error(exc)
        except Exception:
            log.exception("unexpected error on %s", scope["path"])
            response = api.error(InternalError("Internal gateway error."))
        await response(scope, receive, send)


def server_config(asgi: Any, config: Config, **overrides: Any) -> "uvicorn.Config":
    """How the gateway runs under uvicorn, for `yieldgate gateway` and the embedded gateway alike."""
    import uvicorn

    options: dict[str, Any] = dict(
        host=config.server.host, port=config.server.port, loop="uvloop", http="httptools",
        access_log=False, log_level="warning", timeout_graceful_shutdown=10,
        timeout_keep_alive=config.server.keep_alive_s)
    return uvicorn.Config(asgi, **(options | overrides))


def draining_server(app: "GatewayApp", config: Config) -> DrainingServer:
    """The gateway's server for `yieldgate gateway` and `yieldgate up`: SIGTERM drains it."""
    # No uvicorn timeout around the stop: DrainingServer ends what is left itself.
    uv = server_config(app, config, timeout_graceful_shutdown=None)
    return DrainingServer(uv, app.gateway.drain, config.server.drain_s, config.server.stop_timeout_s)


def create_app(config: Config, supervisor: Supervisor | None = None) -> GatewayApp:
    check_exposure(config)
    gw = Gateway(config, supervisor)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await gw.start()
        # Everything loaded so far (modules, tokenizer, price book) lives as long as the process:
        # keep it out of the collector's full passes, which otherwise stall requests for ms.
        gc.collect()
        gc.freeze()
        # Collect the young generation every 50k allocations instead of 700: a collection walks
        # every live young object, and under load that is the state of ~100 requests in flight
        # (token lists of hundreds of ints), so the default paid ~0.5 ms per pass, hundreds of
        # times a second. Objects freed by reference counting never reach the collector.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        try:
            yield
        finally:
            await gw.close()

    app = GatewayApp(title="yieldgate", version="0.1.0", lifespan=lifespan)
    app.state.gateway = app.gateway = gw
    install_openapi(app)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        gw.metrics.rejections.labels(exc.code or exc.type).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(400, str(exc.errors()[:3]), code="invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail),
                              "invalid_request_error" if exc.status_code < 500 else "server_error",
                              code="not_found" if exc.status_code == 404 else None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error on %s", request.url.path)
        return error_response(500, "Internal gateway error.", "server_error", code="internal_error")

    async def api_key(request: Request) -> None:
        # API-key auth for the model list and stored responses (and feedback).
        request.state.api_key = await gw.accounting.authenticate(request)

    admin = admin_only(gw.accounting)
    app.include_router(build_admin_router(admin, gw.fleet, gw.engine_status, gw.accounting, gw.weights))
    app.include_router(build_intake_router(gw.weights.pushes))
    app.include_router(build_adapters_router({p.name: p.adapters for p in gw.models}, admin))
    app.include_router(build_adapter_push_router(gw.adapters, config.fleet, gw.weights.model_dir, admin))
    app.include_router(build_adapter_canary_router(gw.adapters, gw.canary_gate, admin))
    app.include_router(build_feedback_router(gw.accounting, api_key))
    if gw.batch_store is not None:
        app.include_router(build_batch_router(gw.batch_store, gw.accounting, config.lanes.max_file_bytes,
                                              config.limits.max_body_bytes, config.lanes.max_batch_requests))
        app.include_router(build_message_batch_router(gw.batch_store, gw.accounting, config.limits, config.lanes))
    app.include_router(build_dashboard_router(gw.dashboard, config.server.require_keys, admin))

    @app.get("/admin/auto", dependencies=[Depends(admin)])
    async def auto_state() -> Response:
        """`model: "auto"`: per task class, each target's graded counts and $ per solved, the incumbent and why."""
        chooser = gw.models.chooser
        return json_response({"enabled": chooser is not None, "name": gw.models.auto_name,
                              "targets": list(chooser.targets) if chooser else [],
                              "classes": chooser.state() if chooser else {}})
    inference = [Depends(api_key)]

    @app.get("/v1/responses/{response_id}", dependencies=inference)
    async def stored_response(response_id: str) -> Response:
        return await gw.proxy.stored_response(response_id)

    @app.get("/v1/models", dependencies=inference)
    async def models() -> Response:
        return Response(_encode(ModelList(data=model_cards(gw.models))), media_type="application/json")

    @app.get("/v1/models/{model_id:path}", dependencies=inference)
    async def model(model_id: str) -> Response:
        # The openai SDK's models.retrieve(); ids may hold "/" (org/name) and ":" (the fast tier).
        card = next((c for c in model_cards(gw.models) if c.id == model_id), None)
        if card is None:
            raise ModelNotFound(f"The model '{model_id}' does not exist.", param="model")
        return Response(_encode(card), media_type="application/json")

    app.include_router(build_health_router([p.fleet for p in gw.models], gw.metrics, gw.engine_status, gw.drain))
    return app
