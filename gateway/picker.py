"""The endpoint picker: the gateway's request path for an Envoy that proxies the bytes itself.

Envoy's `ext_proc` filter streams each request to `yieldgate picker` over gRPC (the Gateway API
Inference Extension's endpoint-picker protocol). The picker is a transport over the gateway's own
request pipeline (gateway/exchange.py): it authenticates, validates, resolves the tier, admits
(rate limits, budget reservation), tokenizes and routes with the same Exchange the gateway's proxy
uses, and answers with the chosen engine in the `x-gateway-destination-endpoint` header and
`envoy.lb` dynamic metadata; Envoy's ORIGINAL_DST cluster connects there. Refusals are immediate
responses in the route's own error shape (429 over budget or rate, 503 with no healthy replica).
The response comes back through the picker: a unary answer buffered, decorated with tier and cost
and billed; a stream chunk by chunk, billed from its final usage event. See docs/picker.md.

A Responses follow-up (`previous_response_id`) goes to the replica that stored the earlier response
and a request for a LoRA adapter to replicas holding its version (loaded on demand as in the
gateway); the picker places the adapters of its config ([picker] adapters) itself. Not served
here: the admin API, dashboard and weight rollouts, which stay with `yieldgate gateway`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import grpc
import msgspec
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from yieldgate.serving import AdapterLoadFailed

from .accounting import Accounting
from .apis import APIS, ROUTES, Api
from .config import Config, PickerAdapter
from .errors import APIError, InternalError, NotFound, UpstreamError
from .exchange import Exchange, Pipeline
from .metrics import GatewayMetrics
from .responses import yieldgate_headers
from .registry import ModelRegistry, model_cards, open_pools
from .schemas import ModelList

log = logging.getLogger("yieldgate.picker")

ADAPTER_RETRY_S = 5.0   # an adapter no engine could load at start is tried again this often
DESTINATION = "x-gateway-destination-endpoint"   # header and envoy.lb metadata key (the protocol's)
METADATA_NAMESPACE = "envoy.lb"
_encode = msgspec.json.Encoder(decimal_format="number").encode
_BUFFERED = pb.ProcessingResponse(
    response_headers=pb.HeadersResponse(),
    mode_override=processing_mode_pb2.ProcessingMode(
        response_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED))
_SKIP = object()  # a response body chunk forwarded unchanged


def _header_options(pairs: list[tuple[bytes, bytes]]) -> list[base_pb2.HeaderValueOption]:
    return [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k.decode("latin-1"), raw_value=v))
            for k, v in pairs]


def immediate(status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> pb.ProcessingResponse:
    """Envoy answers the client with this itself; nothing reaches an engine."""
    keep = [(k, v) for k, v in headers if k != b"content-length"]  # Envoy sets it from the body
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=status), body=body,
        headers=pb.HeaderMutation(set_headers=_header_options(keep))))


def _refusal(api: Api, exc: APIError) -> pb.ProcessingResponse:
    """An error as the route's own shape (OpenAI's, or Anthropic's on the Messages routes)."""
    resp = api.error(exc)
    return immediate(resp.status_code, resp.body, resp.raw_headers)


@dataclass(slots=True)
class Routed:
    """One routed request as Envoy streams its answer back: the Exchange (gateway/exchange.py)
    seen through ext_proc's response messages."""

    exchange: Exchange
    endpoint: str                  # host:port of the chosen engine
    status: int = 0
    buffered: bool = False

    def response_headers(self, status: int) -> pb.ProcessingResponse:
        """The engine's status line is in: label the answer; a unary 200 is buffered for its usage."""
        self.status = status
        exchange = self.exchange
        ctx = exchange.ctx
        exchange.answered()
        self.buffered = status == 200 and not ctx.stream
        if status != 200:
            # The engine's error body (OpenAI- or Anthropic-shaped already) goes to the client as is.
            exchange.end(f"upstream_{status}")
        elif ctx.stream:
            exchange.stream()
        if self.buffered:
            return _BUFFERED  # headers are sent with the decorated body, cost header included
        headers = yieldgate_headers(ctx)
        if ctx.stream and status == 200:
            headers += [(b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=_header_options(headers)))))

    def response_body(self, data: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
        if self.buffered:
            return self._unary(data)
        out = self._relay(data, end_of_stream) if self.status == 200 and self.exchange.ctx.stream else _SKIP
        common = pb.CommonResponse() if out is _SKIP else \
            pb.CommonResponse(body_mutation=pb.BodyMutation(body=out))  # type: ignore[arg-type]
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))

    def _unary(self, data: bytes) -> pb.ProcessingResponse:
        """The whole answer: billed, with tier and cost added (as the gateway does)."""
        exchange = self.exchange
        exchange.try_over()
        try:
            answer = exchange.answer(data)
        except UpstreamError:  # unreadable: billed as an error, passed on as the engine sent it
            return pb.ProcessingResponse(response_body=pb.BodyResponse())
        headers = [(b"content-length", b"%d" % len(answer)), *yieldgate_headers(exchange.ctx)]
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=_header_options(headers)),
            body_mutation=pb.BodyMutation(body=answer))))

    def _relay(self, data: bytes, end_of_stream: bool) -> bytes | object:
        """A stream chunk, passed through and billed as the gateway's relay does (gateway/relay.py)."""
        exchange = self.exchange
        out = exchange.feed(data)
        if end_of_stream:
            out += exchange.close_stream()
            exchange.end(exchange.ctx.status)
        return _SKIP if out == data else out


class EndpointPicker:
    """The gateway's fleet, routing and accounting, answering Envoy instead of proxying."""

    def __init__(self, config: Config):
        self.config = config
        self.metrics = GatewayMetrics()
        self.registry = ModelRegistry(config, open_pools(config))
        primary = self.registry.primary  # [picker] adapters go on its engines
        self.fleet, self.routing, self.adapters = primary.fleet, primary.routing, primary.adapters
        self.accounting = Accounting(config, self.metrics, self.fleet)
        self.pipeline = Pipeline(config, self.registry, self.accounting)
        self._placing: asyncio.Task | None = None

    async def start(self) -> None:
        for pool in self.registry:
            await pool.fleet.start()
        await self.accounting.start()
        for pool in self.registry:
            await pool.start(None)  # the adapters it places itself: no shared registry
        await self.registry.start_auto(self.accounting)
        self.pipeline.start()
        waiting = [a for a in self.config.picker.adapters if not await self._place(a)]
        if waiting:
            self._placing = asyncio.create_task(self._place_later(waiting))

    async def _place(self, adapter: PickerAdapter) -> bool:
        """One adapter version on its tiers' engines (as the gateway's admin push does); False
        while no engine could take it (an engine still starting)."""
        try:
            await self.adapters.push(adapter.name, adapter.version, adapter.path, adapter.tiers)
        except AdapterLoadFailed as exc:
            log.warning("adapter %s@%s not placed yet: %s", adapter.name, adapter.version, exc.message)
            return False
        return True

    async def _place_later(self, waiting: list[PickerAdapter]) -> None:
        while waiting:
            await asyncio.sleep(ADAPTER_RETRY_S)
            waiting = [a for a in waiting if not await self._place(a)]

    async def close(self) -> None:
        if self._placing is not None:
            self._placing.cancel()
            await asyncio.gather(self._placing, return_exceptions=True)
        await self.registry.close()
        await self.accounting.close()
        for pool in self.registry:
            await pool.close()

    async def pick(self, kind: str, headers: dict[bytes, bytes], body: bytes) -> tuple[Routed, bytes]:
        """Admit and route one request; -> its answer's state and the bytes to send the engine.
        Raises APIError for a refusal."""
        started = time.perf_counter()
        pipeline = self.pipeline
        key = await pipeline.authenticate(kind, headers)
        pipeline.check_size(len(body))
        exchange = pipeline.open(kind, headers, body, key, started)
        try:
            await exchange.admit(_client_address(headers))
            replica = await exchange.route()
            if replica is None:
                raise exchange.no_replica()
        except BaseException:
            exchange.end("error")
            raise
        return Routed(exchange, _host_port(replica.url)), exchange.payload()

    def models(self) -> bytes:
        return _encode(ModelList(data=model_cards(self.registry)))


def _client_address(headers: dict[bytes, bytes]) -> str | None:
    """The client's address: the hop Envoy appended to x-forwarded-for (`use_remote_address`)."""
    forwarded = headers.get(b"x-forwarded-for")
    return forwarded.rsplit(b",", 1)[-1].strip().decode("latin-1") if forwarded else None


def _host_port(url: str) -> str:
    """http://127.0.0.1:8101 -> 127.0.0.1:8101 (the protocol's <ip:port>)."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    return rest if ":" in rest.rsplit("]", 1)[-1] else f"{rest}:{443 if url.startswith('https') else 80}"


def _routed(endpoint: str, payload: bytes, body: bytes) -> pb.ProcessingResponse:
    """The pick, both ways the protocol allows (header and envoy.lb metadata), with the same value."""
    headers = [(DESTINATION.encode(), endpoint.encode())]
    mutation = None
    if payload is not body:
        # Buffered request body: the processor sets a content-length matching the body it sends.
        headers.append((b"content-length", b"%d" % len(payload)))
        mutation = pb.BodyMutation(body=payload)
    metadata = struct_pb2.Struct()
    metadata.fields[METADATA_NAMESPACE].struct_value.fields[DESTINATION].string_value = endpoint
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=_header_options(headers)),
            body_mutation=mutation)),
        dynamic_metadata=metadata)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """One gRPC stream per HTTP request: request headers, buffered request body, response
    headers, response body (buffered for a unary answer, chunks for a stream)."""

    def __init__(self, picker: EndpointPicker):
        self.picker = picker

    async def Process(self, requests: AsyncIterator[pb.ProcessingRequest],
                      context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ProcessingResponse]:
        headers: dict[bytes, bytes] = {}
        kind: str | None = None
        body: list[bytes] = []
        routed: Routed | None = None
        try:
            async for req in requests:
                which = req.WhichOneof("request")
                if which == "request_headers":
                    headers = {h.key.encode("latin-1"): h.raw_value or h.value.encode("latin-1")
                               for h in req.request_headers.headers.headers}
                    path = headers.get(b":path", b"").split(b"?", 1)[0].decode("latin-1")
                    kind = ROUTES.get(path) if headers.get(b":method") == b"POST" else None
                    if kind is None:
                        yield self._not_inference(headers, path)
                        return
                    if req.request_headers.end_of_stream:  # a POST without a body
                        yield await self._pick(kind, headers, b"")
                        return
                    yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
                elif which == "request_body":
                    body.append(req.request_body.body)
                    if not req.request_body.end_of_stream:
                        yield pb.ProcessingResponse(request_body=pb.BodyResponse())
                        continue
                    assert kind is not None
                    whole = body[0] if len(body) == 1 else b"".join(body)
                    try:
                        routed, payload = await self.picker.pick(kind, headers, whole)
                    except APIError as exc:
                        self.picker.metrics.rejections.labels(exc.code or exc.type).inc()
                        yield _refusal(APIS[kind], exc)
                        return
                    yield _routed(routed.endpoint, payload, whole)
                elif which == "response_headers" and routed is not None:
                    status = next((int(h.raw_value or h.value) for h in req.response_headers.headers.headers
                                   if h.key == ":status"), 0)
                    yield routed.response_headers(status)
                elif which == "response_body" and routed is not None:
                    out = routed.response_body(req.response_body.body, req.response_body.end_of_stream)
                    if routed.exchange.stored is not None:
                        # Recorded before the answer goes on, so a follow-up naming it finds it.
                        await routed.exchange.remember()
                    yield out
                else:  # trailers, which the filter config does not send
                    yield _continue(which)
        except Exception:
            log.exception("endpoint picker failed on a request")
            if kind is not None and routed is None:
                yield _refusal(APIS[kind], InternalError("Internal endpoint-picker error."))
        finally:
            if routed is not None:
                routed.exchange.end("aborted")  # no-op unless the client or Envoy left before the end

    async def _pick(self, kind: str, headers: dict[bytes, bytes], body: bytes) -> pb.ProcessingResponse:
        """A POST without a body: refused, by authentication or by validation (400)."""
        try:
            routed, _ = await self.picker.pick(kind, headers, body)
        except APIError as exc:
            return _refusal(APIS[kind], exc)
        routed.exchange.end("error")  # validation refuses an empty body; never routed without one
        return _refusal(APIS[kind], InternalError("Request has no body."))

    def _not_inference(self, headers: dict[bytes, bytes], path: str) -> pb.ProcessingResponse:
        """The model list is the picker's own answer; every other path is not an inference route."""
        if path == "/v1/models" and headers.get(b":method") == b"GET":
            return immediate(200, self.picker.models(), [(b"content-type", b"application/json")])
        resp = NotFound(f"Unknown route {path}: the endpoint picker serves the inference routes "
                        "and /v1/models.").response()
        return immediate(resp.status_code, resp.body, resp.raw_headers)


def _continue(which: str | None) -> pb.ProcessingResponse:
    """Let a message the filter config does not ask for (trailers) pass unchanged."""
    if which in ("request_trailers", "response_trailers"):
        return pb.ProcessingResponse(**{which: pb.TrailersResponse()})
    if which in ("request_headers", "response_headers"):
        return pb.ProcessingResponse(**{which: pb.HeadersResponse()})
    return pb.ProcessingResponse(**{which: pb.BodyResponse()}) if which else pb.ProcessingResponse()


async def start(config: Config) -> tuple[EndpointPicker, grpc.aio.Server]:
    """The picker started (fleet health checks, routing state, ledger) behind its gRPC server:
    the ext_proc service and gRPC health (`grpc.health.v1`, as the protocol asks)."""
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc  # noqa: PLC0415

    picker = EndpointPicker(config)
    await picker.start()
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    address = f"{config.picker.host}:{config.picker.port}"
    try:
        if server.add_insecure_port(address) == 0:
            raise OSError(f"cannot listen on {address}")
    except BaseException:
        await picker.close()
        raise
    await server.start()
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return picker, server


async def stop(picker: EndpointPicker, server: grpc.aio.Server, grace_s: float = 5.0) -> None:
    await server.stop(grace_s)
    await picker.close()


async def serve(config: Config) -> None:
    """`yieldgate picker`: run until interrupted."""
    picker, server = await start(config)
    log.warning("endpoint picker listening on %s:%d", config.picker.host, config.picker.port)
    try:
        await server.wait_for_termination()
    finally:
        await stop(picker, server)


def envoy_config(listen: tuple[str, int], picker: tuple[str, int], admin: tuple[str, int],
                 timeout_s: float = 300.0) -> dict[str, Any]:
    """An Envoy bootstrap (JSON-able) in front of the picker: an ext_proc filter that buffers the
    request body and streams the response to the picker, and an ORIGINAL_DST cluster that
    connects to whatever `x-gateway-destination-endpoint` names. The same shape as the Gateway API
    Inference Extension's Envoy configuration; tests and benchmarks run it, docs/picker.md shows it."""

    def address(host: str, port: int) -> dict[str, Any]:
        return {"socket_address": {"address": host, "port_value": port}}

    ext_proc = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "yieldgate-picker"}, "timeout": "10s"},
        "processing_mode": {"request_header_mode": "SEND", "request_body_mode": "BUFFERED",
                            "response_header_mode": "SEND", "response_body_mode": "STREAMED",
                            "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP"},
        # The picker buffers a unary answer (to add its cost) and streams an SSE one.
        "allow_mode_override": True,
        "message_timeout": "10s",
        "failure_mode_allow": False,   # no pick, no request: never an unbilled, unrouted one
    }
    hcm = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "inference",
        # x-forwarded-for ends with the client's own address: what an anonymous client's
        # concurrent-stream limit counts against, as the gateway counts its peer address.
        "use_remote_address": True,
        "route_config": {"virtual_hosts": [{
            "name": "inference", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"},
                        "route": {"cluster": "engines", "timeout": f"{timeout_s:g}s"}}],
            # Which engine Envoy really connected to, for clients and tests to see.
            "response_headers_to_add": [{"header": {"key": "x-upstream-host", "value": "%UPSTREAM_HOST%"}}],
        }]},
        "http_filters": [
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            {"name": "envoy.filters.http.router",
             "typed_config": {"@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "admin": {"address": address(*admin)},
        "static_resources": {
            "listeners": [{"name": "inference", "address": address(*listen),
                           "filter_chains": [{"filters": [{
                               "name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}]}],
            "clusters": [
                {"name": "engines", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
                 "connect_timeout": "5s",
                 "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}},
                {"name": "yieldgate-picker", "type": "STATIC", "connect_timeout": "2s",
                 "typed_extension_protocol_options": {
                     "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                         "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                         "explicit_http_config": {"http2_protocol_options": {}}}},
                 "load_assignment": {"cluster_name": "yieldgate-picker", "endpoints": [
                     {"lb_endpoints": [{"endpoint": {"address": address(*picker)}}]}]}},
            ],
        },
    }
