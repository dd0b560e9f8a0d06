"""OpenTelemetry traces: one span per inference request, exported over OTLP.

The span opens with the request's Exchange (gateway/exchange.py) and ends in its one idempotent
`end`; it carries the GenAI semantic conventions (operation, model, tokens in and out) and the
gateway's own facts under `yieldgate.*` (cached tokens, cost, tier, replica, weight version, the
route decision and its predicted cache hit). Its W3C `traceparent` goes to the engine with the
upstream request, so an engine that exports its own spans (vLLM's `--otlp-traces-endpoint`) makes
them children of this one. A client's own `traceparent` makes the gateway's span its child.

Off (no `tracing.endpoint`), this module's OpenTelemetry imports never run and no span object is
made: the pipeline only tests `pipeline.tracing is None`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from .config import TracingConfig

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from yieldgate.pricing import Usage

    from .context import RequestContext

# gen_ai.operation.name per API (OpenTelemetry GenAI semantic conventions).
OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "messages": "chat",
              "count_tokens": "count_tokens"}
_OK = ("ok",)


class Tracing:
    """The gateway's tracer provider (its own, not the process-global one: a test or benchmark
    runs several gateways in one process) with a batching OTLP exporter off the request path."""

    def __init__(self, config: TracingConfig, instance_id: str) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if config.protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            exporter: Any = OTLPSpanExporter(endpoint=config.endpoint,
                                             insecure=not config.endpoint.startswith("https://"))
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
            exporter = HttpExporter(endpoint=config.endpoint)
        resource = Resource.create({"service.name": config.service_name, "service.instance.id": instance_id})
        # A client's sampled flag wins; a trace the gateway starts is kept at sample_ratio.
        self.provider = TracerProvider(resource=resource, sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)))
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("yieldgate.gateway")
        self._extract = TraceContextTextMapPropagator().extract
        self._server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)

    def start(self, ctx: "RequestContext", headers: dict[bytes, bytes]) -> "Span":
        """The request's span, from when the gateway got it (ctx.started), a child of the client's
        `traceparent` if it sent one."""
        parent = None
        traceparent = headers.get(b"traceparent")
        if traceparent is not None:
            carrier = {"traceparent": traceparent.decode("latin-1")}
            state = headers.get(b"tracestate")
            if state is not None:
                carrier["tracestate"] = state.decode("latin-1")
            parent = self._extract(carrier)
        operation = OPERATIONS.get(ctx.kind, ctx.kind)
        started_ns = time.time_ns() - int((time.perf_counter() - ctx.started) * 1e9)
        span = self.tracer.start_span(f"{operation} {ctx.model}", context=parent, kind=self._server,
                                      start_time=started_ns)
        if span.is_recording():
            span.set_attributes({
                "gen_ai.operation.name": operation, "gen_ai.provider.name": "vllm",
                "gen_ai.request.model": ctx.model, "yieldgate.request_id": ctx.request_id,
                "yieldgate.stream": ctx.stream})
            if ctx.max_tokens is not None:
                span.set_attribute("gen_ai.request.max_tokens", ctx.max_tokens)
        return span

    @staticmethod
    def traceparent(span: "Span") -> bytes:
        """The raw `traceparent` header line for the upstream request (the engine's spans become
        children of `span`)."""
        c = span.get_span_context()
        return b"traceparent: 00-%032x-%016x-%02x\r\n" % (c.trace_id, c.span_id, c.trace_flags)

    @staticmethod
    def routed(span: "Span", ctx: "RequestContext", decision: Any) -> None:
        """The try's route decision (the last try's wins)."""
        if span.is_recording():
            span.set_attributes({
                "yieldgate.replica": ctx.replica_name, "yieldgate.route.policy": decision.policy,
                "yieldgate.route.predicted_cached_tokens": ctx.predicted_cached_tokens})

    def end(self, span: "Span", ctx: "RequestContext", status: str, usage: "Usage | None") -> None:
        """What the request came to: tokens, cost, tier, weight version, status."""
        if span.is_recording():
            attributes: dict[str, Any] = {
                "yieldgate.status": ctx.status or status, "yieldgate.tier": ctx.priced_tier or ctx.tier,
                "yieldgate.weight_version": ctx.weight_version}
            if ctx.requested_tier:
                attributes["yieldgate.requested_tier"] = ctx.requested_tier
            if ctx.adapter is not None:
                attributes["yieldgate.adapter"] = ctx.adapter.name
            if usage is not None:
                attributes["gen_ai.usage.input_tokens"] = usage.prompt_tokens
                attributes["gen_ai.usage.output_tokens"] = usage.completion_tokens
                attributes["yieldgate.usage.cached_tokens"] = usage.cached_tokens
            if ctx.cost_header:
                attributes["yieldgate.cost_usd"] = float(ctx.cost_header)
            if ctx.ttft is not None:
                attributes["yieldgate.ttft_s"] = ctx.ttft
            span.set_attributes(attributes)
            if (ctx.status or status) not in _OK:
                span.set_status(self._error)
        span.end()

    def shutdown(self) -> None:
        """Export what is buffered, then stop the exporter (bounded by the SDK's timeouts)."""
        self.provider.shutdown()
