"""Bad input: fuzz every public endpoint of a gateway standing in front of the real demo engines.

Two sources of input: schemathesis (positive and negative cases derived from the gateway's own
OpenAPI document, whose request bodies are published from the msgspec Structs) and hand-written
hypothesis strategies for what a schema never says (deep nesting, invalid UTF-8, 10 MB bodies, ...).
What must hold for every case: no 5xx, every 4xx in its route's shape (Anthropic's on /v1/messages,
OpenAI's elsewhere), and the gateway still serves valid traffic afterwards. Requests that reach an engine are capped at 2 output tokens.
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import requests
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable

from conftest import InProcessGateway, record_counts
from yieldgate.gateway.config import Config, RequestLimits
from yieldgate.serving.config import FleetConfig, ReplicaConfig

ERROR_FIELDS = {"message", "type", "param", "code"}
# Examples per (operation, mode) for schemathesis and per strategy for hypothesis: the whole file
# must stay well under 3 minutes on 2 busy cores.
SCHEMA_EXAMPLES = 30
BODY_EXAMPLES = 40

TALLY: dict[str, int] = {}
STATUSES: dict[str, int] = {}
FAILURES: list[str] = []


@pytest.fixture(scope="module")
def fuzz_gateway(stack):
    config = Config(
        limits=RequestLimits(max_tokens=1024),
        fleet=FleetConfig(model=stack.model, health_interval_s=1.0, replicas=[
            ReplicaConfig(name="std-0", tier="standard", url=stack.engines["standard"]),
            ReplicaConfig(name="fast-0", tier="fast", url=stack.engines["fast"]),
        ]))
    config.server.admin_token = "fuzz-admin-token"
    gw = InProcessGateway(config)
    yield gw
    gw.stop()
    _write_results()


def _write_results() -> None:
    total = sum(TALLY.values())
    print(f"\n[fuzz] {total} cases: {TALLY}; failures: {len(FAILURES)}")
    record_counts("fuzz", "tests/test_fuzz_gateway.py", ["gateway/", "cache/", "serving/", "pricing/",
                                                         "tests/test_fuzz_gateway.py"],
                  {"cases": total, "by_source": TALLY, "by_status": dict(sorted(STATUSES.items())),
                   "field_by_field": dict(sorted(DEEP.items())), "failures": len(FAILURES)},
                  failures=FAILURES[:50],
                  checks=["no 5xx", "every 4xx in its route's shape", "gateway serves valid traffic afterwards",
                          "field by field: at least half answered 200 or a 4xx from past the front door"])


# How each kind of stream ends.
STREAM_ENDS = (b"data: [DONE]", b"event: response.completed", b"event: message_stop")


def anthropic_problem(status: int, body: bytes) -> str | None:
    try:
        payload = json.loads(body)
        err = payload["error"]
        if payload["type"] != "error" or set(err) != {"type", "message"} or not err["message"]:
            return f"HTTP {status} error not Anthropic-shaped: {body[:200]!r}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status} body not Anthropic-shaped: {body[:200]!r}"
    return None


def check_response(label: str, status: int, headers, body: bytes) -> str | None:
    """The invariant every fuzz case must satisfy; failures are collected, then asserted."""
    problem = None
    if status >= 500:
        problem = f"HTTP {status}"
    elif status >= 400 and " /v1/messages" in label:
        problem = anthropic_problem(status, body)
    elif status >= 400:
        try:
            err = json.loads(body)["error"]
            if set(err) != ERROR_FIELDS or not isinstance(err["message"], str) or not err["message"]:
                problem = f"HTTP {status} error not OpenAI-shaped: {body[:200]!r}"
        except (ValueError, KeyError, TypeError):
            problem = f"HTTP {status} body not OpenAI-shaped: {body[:200]!r}"
    elif status == 200 and headers.get("content-type", "").startswith("text/event-stream"):
        if not any(end in body for end in STREAM_ENDS):
            problem = "stream without its final event"
    TALLY[label.split(" ")[0]] = TALLY.get(label.split(" ")[0], 0) + 1
    STATUSES[str(status)] = STATUSES.get(str(status), 0) + 1
    if problem:
        FAILURES.append(f"{label}: {problem}")
        return f"{label}: {problem}"
    return None


def cap_engine_work(body, i: int, path: str = ""):
    """Half of the bodies name the served model so they reach an engine; keep those cheap."""
    if not isinstance(body, dict):
        return body
    if i % 2 == 0 and isinstance(body.get("model"), str):
        body["model"] = "demo" if i % 4 == 0 else "demo:fast"
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(field), int) and not isinstance(body.get(field), bool) and body[field] > 2:
            body[field] = 2
    if path == "/v1/responses":
        body.setdefault("max_output_tokens", 2)
    elif "max_tokens" not in body and "max_completion_tokens" not in body:
        body["max_tokens"] = 2
    return body


def assert_still_serving(gw) -> None:
    resp = httpx.post(gw.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": [{"role": "user", "content": "still there?"}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(gw.url + "/healthz", timeout=10).json()["status"] == "ok"


# -- schemathesis: the OpenAPI document ----------------------------------------------------------

def test_openapi_document_is_valid_and_publishes_request_bodies(fuzz_gateway):
    import schemathesis

    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]  # .ok() raises on an invalid operation
    labels = {op.label for op in operations}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models", "GET /healthz",
            "GET /metrics", "GET /admin/fleet", "POST /v1/responses", "POST /v1/messages",
            "POST /v1/messages/count_tokens", "GET /v1/models/{model_id}", "GET /v1/responses/{response_id}"} <= labels
    doc = httpx.get(fuzz_gateway.url + "/openapi.json").json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_schemathesis_every_operation(fuzz_gateway, mode):
    import schemathesis
    from schemathesis import GenerationMode

    start = len(FAILURES)
    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    http = requests.Session()
    counter = iter(range(10**9))
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"schemathesis-{mode} {op.label}"

        @settings(max_examples=SCHEMA_EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy(GenerationMode(mode)))
        def run(case):
            kwargs = case.as_transport_kwargs(base_url=fuzz_gateway.url)
            if "json" in kwargs:
                kwargs["json"] = cap_engine_work(kwargs["json"], next(counter), op.path)
            kwargs.setdefault("timeout", 60)
            resp = http.request(**kwargs)
            check_response(label, resp.status_code, resp.headers, resp.content)

        try:
            run()
        except Unsatisfiable:
            assert mode == "negative"  # nothing to get wrong in an operation without inputs
    assert not FAILURES[start:], FAILURES[start:start + 10]
    assert_still_serving(fuzz_gateway)


# -- hypothesis: bodies no schema describes -----------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20)
roles = st.sampled_from(["user", "system", "assistant", "tool", "", "x" * 100]) | st.text(max_size=8)
contents = (st.text(max_size=60) | st.none() | json_values
            | st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "nope"]),
                                              "text": st.text(max_size=20)}), max_size=3))
messages = st.lists(st.fixed_dictionaries({"role": roles}, optional={"content": contents, "name": json_values}),
                    max_size=5) | json_values
bodies = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["demo", "demo:fast", "demo:slow", "gpt-4o", "", ":fast"]) | json_values,
        "messages": messages,
        "prompt": st.text(max_size=40) | st.lists(st.integers(-5, 5000), max_size=5) | json_values,
        "max_tokens": st.integers(min_value=-(2**64), max_value=2**64) | json_values,
        "max_completion_tokens": st.integers(min_value=-10, max_value=10**9),
        "n": st.integers(min_value=-3, max_value=40),
        "stream": st.booleans() | json_values,
        "stream_options": json_values | st.fixed_dictionaries(
            {}, optional={"include_usage": json_values, "continuous_usage_stats": json_values}),
        "service_tier": st.sampled_from(["auto", "default", "flex", "priority", "gold", "scale"]) | json_values,
        "temperature": json_values,
        "user": json_values,
        "tools": json_values,
    })


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_hypothesis_bodies(fuzz_gateway, path):
    start = len(FAILURES)
    http = requests.Session()
    counter = iter(range(10**9))
    label = f"hypothesis {path}"

    @settings(max_examples=BODY_EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(body=bodies)
    def run(body):
        i = next(counter)
        if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool) \
                and 2 < body["max_tokens"] <= 1024 and body.get("model") in ("demo", "demo:fast"):
            body["max_tokens"] = 2  # keep the huge/negative values, cap the ones an engine would run
        if body.get("max_completion_tokens", 0) > 2 and body["max_completion_tokens"] <= 1024:
            body["max_completion_tokens"] = 2
        if i % 3 == 0 and "max_tokens" not in body:
            body["max_tokens"] = 2
        if isinstance(body.get("n"), int) and body["n"] > 4 and body["n"] <= 16:
            body["n"] = 2
        if body.get("model") in ("demo", "demo:fast") and "max_tokens" not in body \
                and "max_completion_tokens" not in body:
            body["max_tokens"] = 1
        resp = http.post(fuzz_gateway.url + path, data=json.dumps(body), timeout=60,
                         headers={"content-type": "application/json"})
        check_response(label, resp.status_code, resp.headers, resp.content)

    run()
    assert not FAILURES[start:], FAILURES[start:start + 10]
    assert_still_serving(fuzz_gateway)


@given(raw=st.binary(max_size=300))
@settings(max_examples=BODY_EXAMPLES, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_hypothesis_raw_bytes(fuzz_gateway, raw):
    # Arbitrary bytes, including invalid UTF-8, as the body of every POST endpoint.
    for path in ("/v1/chat/completions", "/v1/completions"):
        resp = httpx.post(fuzz_gateway.url + path, content=raw, timeout=30,
                          headers={"content-type": "application/json"})
        problem = check_response("raw-bytes " + path, resp.status_code, resp.headers, resp.content)
        assert problem is None, problem


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


MSG = '{"role":"user","content":"x"}'
SPECIAL_BODIES = {
    "deep-array-10000": ('{"model":"demo","messages":' + _nested(10_000) + "}").encode(),
    "deep-content-10000": ('{"model":"demo","max_tokens":1,"messages":[{"role":"user","content":[{"type":"text","text":"x","deep":'
                           + _nested(10_000) + "}]}]}").encode(),
    "deep-object-5000": ('{"model":"demo","messages":[' + MSG + '],"max_tokens":1,"metadata":'
                         + '{"a":' * 5000 + "1" + "}" * 5000 + "}").encode(),
    "invalid-utf8-content": b'{"model":"demo","max_tokens":1,"messages":[{"role":"user","content":"\xff\xfe\xc3"}]}',
    "lone-surrogate": b'{"model":"demo","max_tokens":1,"messages":[{"role":"user","content":"\\ud800"}]}',
    "nul-bytes": b'{"model":"demo","max_tokens":1,"messages":[{"role":"user","content":"a\\u0000b"}]}',
    "body-10mb": b'{"model":"demo","messages":[{"role":"user","content":"' + b"a" * (10 * 1024 * 1024) + b'"}]}',
    "messages-5000": ('{"model":"demo","max_tokens":1,"messages":[' + ",".join([MSG] * 5000) + "]}").encode(),
    "messages-2000-valid": ('{"model":"demo","max_tokens":1,"messages":[' + ",".join([MSG] * 200) + "]}").encode(),
    "max-tokens-negative": b'{"model":"demo","max_tokens":-1,"messages":[' + MSG.encode() + b"]}",
    "max-tokens-zero": b'{"model":"demo","max_tokens":0,"messages":[' + MSG.encode() + b"]}",
    "max-tokens-huge": b'{"model":"demo","max_tokens":99999999999999999999999999,"messages":[' + MSG.encode() + b"]}",
    "max-tokens-float": b'{"model":"demo","max_tokens":1.5,"messages":[' + MSG.encode() + b"]}",
    "max-tokens-string": b'{"model":"demo","max_tokens":"2","messages":[' + MSG.encode() + b"]}",
    "max-tokens-inf": b'{"model":"demo","max_tokens":1e999,"messages":[' + MSG.encode() + b"]}",
    "unknown-tier": b'{"model":"demo","service_tier":"platinum","messages":[' + MSG.encode() + b"]}",
    "unknown-model": b'{"model":"gpt-5","messages":[' + MSG.encode() + b"]}",
    "unknown-model-fast": b'{"model":"gpt-5:fast","messages":[' + MSG.encode() + b"]}",
    "stream-options-string": b'{"model":"demo","stream":true,"stream_options":"yes","max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "stream-options-list": b'{"model":"demo","stream":true,"stream_options":[1],"max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "stream-options-bad-field": b'{"model":"demo","stream":true,"stream_options":{"include_usage":"yes"},"max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "stream-options-unknown-field": b'{"model":"demo","stream":true,"stream_options":{"bogus":1},"max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "stream-options-without-stream": b'{"model":"demo","stream_options":{"include_usage":true},"max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "stream-string": b'{"model":"demo","stream":"true","max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "duplicate-keys": b'{"model":"demo","model":"demo:fast","max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "n-huge": b'{"model":"demo","n":100000,"max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "prompt-token-ids-out-of-vocab": b'{"model":"demo","max_tokens":1,"prompt":[999999,-1]}',
    "prompt-nested-lists": b'{"model":"demo","max_tokens":1,"prompt":[[1,2],[3,[4]]]}',
    "prompt-object": b'{"model":"demo","max_tokens":1,"prompt":{"a":1}}',
    "role-huge": ('{"model":"demo","max_tokens":1,"messages":[{"role":"' + "u" * 100_000 + '","content":"x"}]}').encode(),
    "trailing-garbage": b'{"model":"demo","max_tokens":1,"messages":[' + MSG.encode() + b"]} trailing",
    "bom-prefixed": b'\xef\xbb\xbf{"model":"demo","max_tokens":1,"messages":[' + MSG.encode() + b"]}",
    "json-null": b"null",
    "json-number": b"1e309",
}


@pytest.mark.parametrize("name", sorted(SPECIAL_BODIES))
def test_special_bodies(fuzz_gateway, name):
    body = SPECIAL_BODIES[name]
    path = "/v1/completions" if name.startswith("prompt") else "/v1/chat/completions"
    resp = httpx.post(fuzz_gateway.url + path, content=body, timeout=60,
                      headers={"content-type": "application/json"})
    problem = check_response("special " + name, resp.status_code, resp.headers, resp.content)
    assert problem is None, problem
    if name == "body-10mb":
        assert resp.status_code == 413
    if name.startswith(("max-tokens", "unknown-tier", "messages-5000", "stream-options-string", "n-huge")):
        assert resp.status_code == 400, resp.text
    if name.startswith("unknown-model"):
        assert resp.status_code == 404


def test_odd_methods_headers_and_paths(fuzz_gateway):
    start = len(FAILURES)
    url = fuzz_gateway.url
    cases = [
        ("GET", "/v1/chat/completions", {}, b""),
        ("PUT", "/v1/completions", {}, b"{}"),
        ("DELETE", "/v1/models", {}, b""),
        ("POST", "/v1/chat/completions", {"content-type": "text/plain"}, b"hello"),
        ("POST", "/v1/chat/completions", {"content-type": "application/json", "x-request-id": b"\xff" * 10}, b"{}"),
        ("GET", "/v1/" + "a" * 8000, {}, b""),
        ("GET", "/admin/fleet", {"authorization": "Bearer " + "x" * 10_000}, b""),
        ("GET", "/admin/../v1/models", {}, b""),
        ("GET", "/%00", {}, b""),
    ]
    with httpx.Client(timeout=30) as http:
        for method, path, headers, body in cases:
            try:
                resp = http.request(method, url + path, headers=headers, content=body)
            except httpx.HTTPError as exc:
                # A dropped connection is no answer: every odd request must get an HTTP status back
                # (4xx is fine), or a client cannot tell a refusal from a crash.
                TALLY["odd"] = TALLY.get("odd", 0) + 1
                FAILURES.append(f"odd {method} {path[:40]}: no response ({type(exc).__name__}: {exc})")
                continue
            check_response(f"odd {method} {path[:40]}", resp.status_code, resp.headers, resp.content)
    # A declared length far above the limit is refused before the body is read.
    with socket.create_connection(("127.0.0.1", fuzz_gateway.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 99999999999\r\n\r\n{}")
        head = sock.recv(65536)
    status = int(head.split(b" ", 2)[1])
    problem = check_response("odd declared-length", status, {}, head.split(b"\r\n\r\n", 1)[1])
    assert status == 413 and problem is None, head[:300]
    assert not FAILURES[start:], FAILURES[start:]
    assert_still_serving(fuzz_gateway)


# -- field by field: valid, authenticated bodies, one field changed at a time --------------------
# Schema-valid requests with an API key, each with one field dropped, nulled, given another valid value,
# a boundary value or a value of the wrong type: most get past auth and validation into routing,
# pricing and an engine, where the schema-level fuzzing above rarely arrives.

BASE_BODIES = {
    "/v1/chat/completions": {"model": "demo", "messages": [{"role": "system", "content": "be brief"},
                                                           {"role": "user", "content": "hi there"}],
                             "max_tokens": 2, "temperature": 0.7, "stream": False},
    "/v1/completions": {"model": "demo", "prompt": "once upon a time", "max_tokens": 2, "temperature": 0.7},
    "/v1/responses": {"model": "demo", "input": "hi there", "max_output_tokens": 2, "instructions": "be brief"},
    "/v1/messages": {"model": "demo", "max_tokens": 2, "system": "be brief",
                     "messages": [{"role": "user", "content": "hi there"}]},
}
# Per field: other values, valid first (these should be answered), then boundaries and wrong types.
FIELD_VALUES = {
    "model": ["demo:fast", "DEMO", "demo:", "other-model", 7],
    "messages": [[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                 [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
                 [{"role": "developer", "content": "x"}, {"role": "user", "content": "y"}], [], "hi"],
    "prompt": ["", ["a", "b"], [1, 2, 3], "x" * 2000, 5],
    "input": [[{"role": "user", "content": "hi"}], [{"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "hi"}]}], "", 5],
    "system": [[{"type": "text", "text": "be brief"}], "", 5],
    "instructions": ["", "x" * 500, 5],
    "max_tokens": [1, 0, -1, 10**9, "2", 1.5],
    "max_output_tokens": [1, 16, 0, -1, "2"],
    "temperature": [0, 0.0, 1.5, 2, -1, 100, "hot"],
    "stream": [True, "yes"],
    "extra": [("top_p", 0.5), ("top_p", 2), ("seed", 7), ("stop", ["\n"]), ("stop", "x"), ("n", 2), ("n", 0),
              ("service_tier", "priority"), ("service_tier", "flex"), ("service_tier", "gold"), ("user", "fuzzer"),
              ("metadata", {"k": "v"}), ("presence_penalty", 0.5), ("frequency_penalty", 3),
              ("logprobs", True), ("top_logprobs", 2), ("response_format", {"type": "json_object"}),
              ("stream_options", {"include_usage": True}), ("unknown_field", 1), ("top_k", 5),
              ("stop_sequences", ["x"]), ("tools", []), ("tool_choice", "none")],
}
# A 4xx from schema validation or JSON decoding (the gateway's front door); any other 4xx is an answer
# from deeper in: a model, tier, budget, context or engine-side parameter check.
FRONT_DOOR = ("Expected `", "at `$", "missing required field", "Object contains unknown field", "JSON is malformed",
              "Invalid JSON", "invalid json")
DEEP: dict[str, int] = {}


def field_cases() -> list[tuple[str, str, dict]]:
    cases = []
    for path, base in BASE_BODIES.items():
        cases.append((path, "as is", dict(base)))
        for field in base:
            cases.append((path, f"{field} dropped", {k: v for k, v in base.items() if k != field}))
            cases.append((path, f"{field} null", {**base, field: None}))
            for value in FIELD_VALUES.get(field, []):
                cases.append((path, f"{field}={json.dumps(value)[:30]}", {**base, field: value}))
        for name, value in FIELD_VALUES["extra"]:
            cases.append((path, f"+{name}={json.dumps(value)[:30]}", {**base, name: value}))
    return cases


def cap(body: dict) -> dict:
    """Cases an engine serves stay at 2 output tokens (n ≤ 2)."""
    for field in ("max_tokens", "max_output_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and 2 < value <= 1024:
            body[field] = 2
    if "max_tokens" not in body and "max_output_tokens" not in body and "max_completion_tokens" not in body:
        body["max_output_tokens" if "input" in body else "max_tokens"] = 2
    return body


@pytest.fixture(scope="module")
def api_key(fuzz_gateway) -> str:
    resp = httpx.post(fuzz_gateway.url + "/admin/keys", json={"team": "fuzz", "name": "field-by-field"},
                      headers={"authorization": "Bearer fuzz-admin-token"}, timeout=30)
    assert resp.status_code == 201, resp.text
    return resp.json()["secret"]


def test_valid_bodies_mutated_field_by_field_reach_the_pipeline(fuzz_gateway, api_key):
    start = len(FAILURES)
    cases = field_cases()
    with httpx.Client(timeout=120, headers={"authorization": f"Bearer {api_key}",
                                            "anthropic-version": "2023-06-01"}) as http:
        for path, what, body in cases:
            resp = http.post(fuzz_gateway.url + path, json=cap(body))
            check_response(f"field {path} {what}", resp.status_code, resp.headers, resp.content)
            if resp.status_code == 200:
                stage = "answered"
            elif 400 <= resp.status_code < 500:
                text = resp.text
                stage = "front_door_4xx" if resp.status_code in (401, 413, 415, 422) or any(
                    m in text for m in FRONT_DOOR) else "semantic_4xx"
            else:
                stage = str(resp.status_code)
            DEEP[stage] = DEEP.get(stage, 0) + 1
    deep = DEEP.get("answered", 0) + DEEP.get("semantic_4xx", 0)
    print(f"\n[fuzz] field by field: {len(cases)} cases: {DEEP}")
    assert not FAILURES[start:], FAILURES[start:start + 10]
    assert DEEP.get("answered", 0) > len(cases) / 3, DEEP  # most valid alternatives are served
    assert deep >= len(cases) / 2, f"only {deep}/{len(cases)} got past the front door: {DEEP}"
    assert_still_serving(fuzz_gateway)
