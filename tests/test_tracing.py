"""OpenTelemetry traces: a gateway with `tracing.endpoint` set, in front of a real vLLM engine that
exports its own spans (`--otlp-traces-endpoint`), both sending to a real OTLP/gRPC receiver
(benchmarks/otlp_receiver.py, the collector's TraceService). Requests come through the official
openai client; every request gives one gateway span with the GenAI attributes and the gateway's
own, and the engine's span is its child in the same trace.
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
from pathlib import Path

import openai
import pytest

from engines import running_engine
from polling import until
from yieldgate.gateway.config import Config, ServerConfig, TracingConfig
from yieldgate.gateway.embedded import GatewayProcess
from yieldgate.serving.config import FleetConfig, ReplicaConfig

ROOT = Path(__file__).resolve().parent.parent
# A vLLM engine of its own and gateway processes: start-up alone can take minutes on a busy host.
pytestmark = pytest.mark.timeout(1500)
_spec = importlib.util.spec_from_file_location("otlp_receiver", ROOT / "benchmarks" / "otlp_receiver.py")
otlp_receiver = importlib.util.module_from_spec(_spec)
sys.modules["otlp_receiver"] = otlp_receiver
_spec.loader.exec_module(otlp_receiver)

BASE = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))
RECEIVER = f"127.0.13.1:{BASE + 417}"
ENGINE_HOST, ENGINE_PORT = "127.0.13.2", BASE + 418
GATEWAY_HOST, GATEWAY_PORT = "127.0.13.3", BASE + 419


@pytest.fixture(scope="module")
def receiver():
    r = otlp_receiver.OtlpReceiver(RECEIVER).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def traced_engine(receiver, tmp_path_factory):
    from yieldgate.serving.demo_model import ensure_demo_model

    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with running_engine(ensure_demo_model(), ENGINE_PORT, log, "--otlp-traces-endpoint", receiver.endpoint,
                        plugin=False, host=ENGINE_HOST, env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
                                                             "OTEL_SERVICE_NAME": "vllm-engine"}) as url:
        yield url


@pytest.fixture(scope="module")
def traced_gateway(traced_engine, receiver, redis_url, tmp_path_factory):
    from yieldgate.serving.demo_model import ensure_demo_model

    config = Config(
        server=ServerConfig(host=GATEWAY_HOST, redis_url=redis_url, admin_token=secrets.token_hex(8),
                            data_dir=str(tmp_path_factory.mktemp("data"))),
        fleet=FleetConfig(model="demo", model_path=str(ensure_demo_model()), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="std-1", tier="standard", url=traced_engine)]),
        tracing=TracingConfig(endpoint=receiver.endpoint, service_name="yieldgate-test"))
    gw = GatewayProcess(config, tmp_path_factory.mktemp("gw"), port=GATEWAY_PORT, start_timeout_s=240)
    try:
        yield gw
    finally:
        gw.stop()


def _spans_of(receiver, request_id: str):
    return [s for s in receiver.snapshot() if s.attributes.get("yieldgate.request_id") == request_id]


def test_each_request_gives_a_gateway_span_with_the_genai_attributes_and_the_engine_span_as_its_child(
        traced_gateway, receiver):
    client = openai.OpenAI(base_url=traced_gateway.url + "/v1", api_key="unused", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(
        model="demo", max_tokens=8, messages=[{"role": "user", "content": "trace me " + secrets.token_hex(4)}])
    unary_id = raw.headers["x-request-id"] if "x-request-id" in raw.headers else None
    answer = raw.parse()
    stream = client.chat.completions.create(
        model="demo", max_tokens=8, stream=True, stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "stream me " + secrets.token_hex(4)}])
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0

    gateway_spans = until(lambda: (lambda g: g if len(g) >= 2 else None)(
        [s for s in receiver.snapshot() if s.service == "yieldgate-test"]), "two gateway spans exported", 300)
    by_stream = {s.attributes["yieldgate.stream"]: s for s in gateway_spans}
    unary, streamed = by_stream[False], by_stream[True]
    if unary_id is not None:
        assert unary.attributes["yieldgate.request_id"] == unary_id
    for span, usage in ((unary, answer.usage), (streamed, chunks[-1].usage)):
        a = span.attributes
        assert span.name == "chat demo"
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "demo"
        assert a["gen_ai.request.max_tokens"] == 8
        assert a["gen_ai.usage.input_tokens"] == usage.prompt_tokens
        assert a["gen_ai.usage.output_tokens"] == usage.completion_tokens
        assert a["yieldgate.usage.cached_tokens"] == (usage.prompt_tokens_details.cached_tokens or 0
                                                       if usage.prompt_tokens_details else 0)
        assert a["yieldgate.tier"] == "standard" and a["yieldgate.replica"] == "std-1"
        assert a["yieldgate.status"] == "ok"
        assert a["yieldgate.cost_usd"] > 0
        assert a["yieldgate.route.policy"]
        assert "yieldgate.route.predicted_cached_tokens" in a and "yieldgate.weight_version" in a
        assert span.parent_span_id == ""  # the client sent no traceparent: the gateway's span is the root

    # vLLM exports a span per request from its API server, a child of the gateway's.
    def engine_children():
        engine = [s for s in receiver.snapshot() if s.service.startswith("vllm")]
        parents = {s.parent_span_id for s in engine}
        return engine if {unary.span_id, streamed.span_id} <= parents else None

    engine = until(engine_children, "engine spans with the gateway's spans as parents", 300)
    for parent in (unary, streamed):
        child = next(s for s in engine if s.parent_span_id == parent.span_id)
        assert child.trace_id == parent.trace_id
        assert child.attributes.get("gen_ai.response.model", "demo") == "demo"


def test_a_clients_traceparent_makes_the_gateway_span_its_child(traced_gateway, receiver):
    trace_id, parent_id = secrets.token_hex(16), secrets.token_hex(8)
    client = openai.OpenAI(base_url=traced_gateway.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model="demo", max_tokens=4, prompt="hello " + secrets.token_hex(4),
                              extra_headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    span = until(lambda: next((s for s in receiver.snapshot()
                               if s.service == "yieldgate-test" and s.trace_id == trace_id), None),
                 "the gateway span in the client's trace", 300)
    assert span.parent_span_id == parent_id
    assert span.name == "text_completion demo" and span.attributes["gen_ai.operation.name"] == "text_completion"
    until(lambda: any(s.parent_span_id == span.span_id and s.service.startswith("vllm")
                      for s in receiver.snapshot()), "the engine span under it", 300)


def test_a_trace_the_client_did_not_sample_is_not_exported(traced_gateway, receiver):
    trace_id = secrets.token_hex(16)
    client = openai.OpenAI(base_url=traced_gateway.url + "/v1", api_key="unused", max_retries=0)
    client.completions.create(model="demo", max_tokens=4, prompt="unsampled",
                              extra_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-00"})
    # A sampled request after it: once its span is exported, the unsampled one would have been too.
    marker = secrets.token_hex(16)
    client.completions.create(model="demo", max_tokens=4, prompt="sampled",
                              extra_headers={"traceparent": f"00-{marker}-{secrets.token_hex(8)}-01"})
    until(lambda: any(s.trace_id == marker and s.service == "yieldgate-test" for s in receiver.snapshot()),
          "the sampled request's span", 300)
    assert not [s for s in receiver.snapshot() if s.trace_id == trace_id]


def test_tracing_off_imports_no_tracer_and_makes_no_span(redis_url, tmp_path):
    """Off by default: the pipeline's tracing is None, so no span object can be made; a fresh
    interpreter building a gateway never imports OpenTelemetry's tracer SDK or an exporter (the
    redis client imports OpenTelemetry's API and metrics SDK for its own optional metrics)."""
    import subprocess

    code = ("import sys; from yieldgate.gateway.app import create_app; from yieldgate.gateway.config import Config, "
            "ServerConfig; app = create_app(Config(server=ServerConfig(redis_url=sys.argv[1], data_dir=sys.argv[2]))); "
            "assert app.gateway.pipeline.tracing is None; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk.trace', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code, redis_url, str(tmp_path)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
