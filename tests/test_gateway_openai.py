"""The gateway through the official `openai` client, against the real demo fleet."""

from __future__ import annotations

import urllib.request
import uuid

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from test_agent_routes import ledger_rows

LONG_SYSTEM = ("You are the release assistant for the yieldgate project. " * 30).strip()


def engine_metric(url: str, name: str) -> float:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in (name, name + "_total"):
                total += s.value
    return total


def engine_usage(stack, path: str, body: dict) -> dict:
    """The usage the standard engine itself reports for the same request, sent to it directly."""
    resp = httpx.post(stack.engines["standard"] + path, json={"model": stack.model, **body}, timeout=60)
    resp.raise_for_status()
    return resp.json()["usage"]


def cached_tokens(usage) -> int:
    details = usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_chat_completion_returns_text_and_usage(client, stack):
    # ignore_eos: the demo model samples its end-of-sequence token now and then; usage must be exact.
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "ignore_eos": True}
    raw = client.chat.completions.with_raw_response.create(
        model=stack.model, messages=body["messages"], max_tokens=8, extra_body={"ignore_eos": True})
    resp = raw.parse()
    assert resp.choices[0].message.content
    engine = engine_usage(stack, "/v1/chat/completions", body)
    assert resp.usage.prompt_tokens == engine["prompt_tokens"] > 0
    assert resp.usage.completion_tokens == engine["completion_tokens"] == 8
    # Shorter than one KV block (32 tokens): nothing can be served from the prefix cache.
    assert resp.usage.prompt_tokens < 32 and cached_tokens(resp.usage) == 0
    assert resp.service_tier == "default"
    assert raw.headers["x-yieldgate-tier"] == "standard"
    assert raw.headers["x-yieldgate-replica"] == "standard-0"
    assert resp.system_fingerprint.startswith("yieldgate-")


def test_stream_passes_chunks_and_final_usage(client, stack):
    stream = client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})  # the random demo model may sample its end-of-sequence token
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) > 1  # forwarded chunk by chunk, not collapsed
    usage_chunks = [c for c in chunks if c.usage is not None]
    assert len(usage_chunks) == 1 and chunks[-1].usage is not None
    usage = usage_chunks[0].usage
    assert usage.completion_tokens == 12
    engine = engine_usage(stack, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "Count to ten."}], "max_tokens": 1})
    assert usage.prompt_tokens == engine["prompt_tokens"] < 32 and cached_tokens(usage) == 0
    assert usage_chunks[0].service_tier == "default"


def test_stream_without_include_usage_has_no_usage_chunk(client, stack):
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=True))
    assert chunks and all(c.usage is None for c in chunks)


def test_stream_with_continuous_usage_is_billed_from_its_final_usage(client, stack):
    """vLLM's stream_options.continuous_usage_stats puts the running usage in every event: the client
    that asked gets it, and the gateway bills (and adds the cost to) the final usage only."""
    request_id = "req-continuous-" + uuid.uuid4().hex
    chunks = list(client.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Count to ten."}], max_tokens=12, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True}, extra_headers={"x-request-id": request_id}))
    running = [c.usage.completion_tokens for c in chunks if c.choices and c.usage is not None]
    assert len(running) > 1 and running == sorted(running) and running[-1] == 12
    assert all("cost" not in c.usage.model_dump() for c in chunks if c.choices and c.usage is not None)
    final = chunks[-1]
    assert not final.choices and final.usage.completion_tokens == 12 and "cost" in final.usage.model_dump()
    rows = ledger_rows(stack, request_id)
    assert [(r["status"], int(r["completion_tokens"])) for r in rows] == [("ok", 12)]


def test_completions_unary_and_stream(client, stack):
    # ignore_eos: the random demo model samples its end-of-sequence token now and then; this test
    # is about usage being passed through, not about when the model stops.
    resp = client.completions.create(model=stack.model, prompt="The capital of France is", max_tokens=6,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text and resp.usage.completion_tokens == 6
    engine = engine_usage(stack, "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 1})
    assert resp.usage.prompt_tokens == engine["prompt_tokens"] < 32 and cached_tokens(resp.usage) == 0
    chunks = list(client.completions.create(model=stack.model, prompt="Once upon a time", max_tokens=6,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6


@pytest.mark.parametrize("how", ["suffix", "service_tier"])
def test_fast_tier_selection(client, stack, how):
    kwargs = {"model": stack.model + ":fast"} if how == "suffix" else {"model": stack.model, "service_tier": "priority"}
    raw = client.chat.completions.with_raw_response.create(
        messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kwargs)
    assert raw.headers["x-yieldgate-tier"] == "fast"
    assert raw.headers["x-yieldgate-replica"] == "fast-0"
    assert raw.parse().service_tier == "priority"


def test_flex_and_auto_go_to_standard(client, stack):
    for tier in ("auto", "default", "flex"):
        raw = client.chat.completions.with_raw_response.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2, service_tier=tier)
        assert raw.headers["x-yieldgate-tier"] == "standard"


def test_repeated_long_prefix_is_cached(client, stack):
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "first question"}]
    first = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens > 128
    messages[1]["content"] = "second question"
    second = client.chat.completions.create(model=stack.model, messages=messages, max_tokens=2)
    assert second.usage.prompt_tokens_details.cached_tokens >= 96


def test_spec_decode_counters_move_on_fast_tier_only(client, stack):
    names = "vllm:spec_decode_num_draft_tokens"
    fast_before = engine_metric(stack.engines["fast"], names)
    std_before = engine_metric(stack.engines["standard"], names)
    # A repetitive prompt gives the ngram proposer matches to draft from.
    prompt = "a b c d e f g a b c d e f g a b c d e f g a b c d e f g " * 4
    for model in (stack.model + ":fast", stack.model):
        client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0)
    assert engine_metric(stack.engines["fast"], names) > fast_before
    assert engine_metric(stack.engines["standard"], names) == std_before


def test_models_lists_both_tiers(client, stack):
    ids = {m.id for m in client.models.list().data}
    assert ids == {stack.model, stack.model + ":fast"}


def _post(stack, body: bytes | str, path: str = "/v1/chat/completions") -> httpx.Response:
    return httpx.post(stack.gateway_url + path, content=body, headers={"content-type": "application/json"}, timeout=30)


def _assert_openai_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param
    if code is not None:
        assert err["code"] == code


def test_errors_are_openai_shaped(stack):
    _assert_openai_error(_post(stack, b"{not json"), 400, code="invalid_json")
    _assert_openai_error(_post(stack, b""), 400)
    _assert_openai_error(_post(stack, b"[1,2]"), 400)
    _assert_openai_error(_post(stack, '{"model":"nope","messages":[{"role":"user","content":"x"}]}'), 404,
                         param="model", code="model_not_found")
    _assert_openai_error(_post(stack, '{"model":"demo"}'), 400, param="messages")
    _assert_openai_error(_post(stack, '{"model":"demo","messages":[]}'), 400, param="messages")
    _assert_openai_error(_post(stack, '{"model":"demo","messages":[{"role":"user","content":"x"}],"max_tokens":-5}'),
                         400, param="max_tokens")
    _assert_openai_error(_post(stack, '{"model":"demo","messages":[{"role":"user","content":"x"}],"service_tier":"gold"}'),
                         400, param="service_tier")
    _assert_openai_error(_post(stack, '{"model":"demo"}', "/v1/completions"), 400, param="prompt")
    _assert_openai_error(httpx.get(stack.gateway_url + "/v1/nothing-here"), 404)


def test_openai_client_sees_typed_errors(client, stack):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])
    assert exc.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "x"}], max_tokens=-1)


def test_unknown_fields_reach_the_engine(client, stack):
    # `ignore_eos` is a vLLM extension the gateway does not declare: it must be forwarded.
    resp = client.completions.create(model=stack.model, prompt="hi", max_tokens=16, extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 16


def test_gateway_metrics(client, stack):
    client.chat.completions.create(model=stack.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    text = httpx.get(stack.gateway_url + "/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    for name in ("yieldgate_requests_total", "yieldgate_tokens_total", "yieldgate_ttft_seconds_bucket",
                 "yieldgate_request_duration_seconds_bucket", "yieldgate_replica_up"):
        assert name in names
    health = httpx.get(stack.gateway_url + "/healthz").json()
    assert health["status"] == "ok" and set(health["replicas"]) == {"standard-0", "fast-0"}
