"""Agent clients through the gateway: OpenAI's Responses API and Anthropic's Messages API on the
real demo stack, spoken by the official `openai` and `anthropic` clients. Every answer's cost must
be the ledger's for that request, recorded once; bad input gets a 4xx in the route's own shape.
"""

from __future__ import annotations

import csv
import io
import time
import uuid
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest
import redis

from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import http_status
from yieldgate.serving.config import FleetConfig, ReplicaConfig

# Long enough to fill whole KV blocks (32 tokens), so the second request reads it from the cache.
INSTRUCTIONS = "You are a careful coding agent. Answer briefly, cite files, never guess. " * 8


def rid(tag: str) -> str:
    return f"req-agent-{tag}-{uuid.uuid4().hex}"


def ledger_rows(stack, request_id: str, timeout: float = 20) -> list[dict[str, str]]:
    """The ledger's rows of one request (waiting until at least one is stored)."""
    deadline = time.monotonic() + timeout
    while True:
        resp = httpx.get(stack.gateway_url + "/admin/ledger.csv", timeout=30,
                         headers={"authorization": f"Bearer {stack.admin_token}"})
        resp.raise_for_status()
        rows = [r for r in csv.DictReader(io.StringIO(resp.text)) if r["request_id"] == request_id]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def only_row(stack, request_id: str) -> dict[str, str]:
    rows = ledger_rows(stack, request_id)
    assert len(rows) == 1, rows
    return rows[0]


def money(value) -> Decimal:
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(str(value))


@pytest.fixture(scope="module")
def oai(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(stack):
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key="unused", max_retries=0, timeout=120)


# -- OpenAI Responses ------------------------------------------------------------------------------


def test_responses_unary_cost_is_the_ledger_cost(stack, oai):
    for attempt in range(2):  # the second reads the instructions from the prefix cache
        request_id = rid("resp")
        raw = oai.responses.with_raw_response.create(
            model="demo", instructions=INSTRUCTIONS, input="Which file holds the proxy?",
            max_output_tokens=5, extra_headers={"x-request-id": request_id},
            extra_body={"ignore_eos": True})
        resp = raw.parse()
        u = resp.usage
        cost = u.model_extra["cost"]
        row = only_row(stack, request_id)
        assert (row["status"], row["tier"], row["replica"]) == ("ok", "standard", "standard-0")
        assert (int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["completion_tokens"])) == \
            (u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens)
        assert u.output_tokens == 5
        assert money(cost["total"]) == Decimal(row["cost_total"]) == Decimal(raw.headers["x-yieldgate-cost-usd"])
        assert money(cost["cached_input"]) == Decimal(row["cost_cached_input"])
        assert resp.service_tier == "default"
    assert u.input_tokens_details.cached_tokens > 0  # cached input is read from input_tokens_details


def test_responses_stream_bills_once_and_puts_cost_on_response_completed(stack, oai):
    request_id = rid("resp-stream")
    events = list(oai.responses.create(model="demo:fast", input="Count to five.", max_output_tokens=7,
                                       stream=True, extra_headers={"x-request-id": request_id},
                                       extra_body={"ignore_eos": True}))
    assert events[-1].type == "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    final = events[-1].response
    assert final.service_tier == "priority" and final.usage.output_tokens == 7
    row = only_row(stack, request_id)
    assert (row["status"], row["tier"], row["replica"]) == ("ok", "fast", "fast-0")
    assert (int(row["prompt_tokens"]), int(row["completion_tokens"])) == \
        (final.usage.input_tokens, final.usage.output_tokens)
    assert money(final.usage.model_extra["cost"]["total"]) == Decimal(row["cost_total"]) > 0
    assert 1 <= len(deltas) <= 7


def test_abandoned_responses_stream_is_billed_once_on_the_deltas_relayed(stack):
    # As for chat streams: an attempt whose whole stream was generated before the client left is
    # billed `ok` and does not count; a gateway that never notices the client leave fails all three.
    for _ in range(3):
        request_id = rid("resp-abandon")
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", stack.base_url + "/responses", headers={"x-request-id": request_id},
                             json={"model": "demo", "input": "Write a very long story.", "stream": True,
                                   "max_output_tokens": 1500, "ignore_eos": True}) as resp:
                assert resp.status_code == 200
                deltas = 0
                for line in resp.iter_lines():
                    if line == "event: response.output_text.delta":
                        deltas += 1
                        if deltas == 2:
                            break
        row = only_row(stack, request_id)
        if not (row["status"] == "ok" and int(row["completion_tokens"]) == 1500):
            break
    assert row["status"] == "aborted", row
    # Billed on the text deltas relayed so far (at least the two the client read), prompt estimated.
    assert 2 <= int(row["completion_tokens"]) < 1500 and int(row["prompt_tokens"]) > 0
    assert Decimal(row["cost_total"]) > 0
    time.sleep(0.5)
    assert len(ledger_rows(stack, request_id)) == 1


def test_previous_response_id_reaches_the_replica_that_stored_it(stack, oai, redis_url):
    first = oai.responses.with_raw_response.create(model="demo:fast", input="Remember the word teal.",
                                                   max_output_tokens=4)
    assert first.headers["x-yieldgate-replica"] == "fast-0"
    first_id = first.parse().id
    # The follow-up asks for the standard tier; only fast-0 has the stored conversation.
    request_id = rid("follow")
    raw = oai.responses.with_raw_response.create(model="demo", input="Which word?", max_output_tokens=4,
                                                 previous_response_id=first_id,
                                                 extra_headers={"x-request-id": request_id})
    follow = raw.parse()
    assert raw.headers["x-yieldgate-replica"] == "fast-0"
    assert raw.headers["x-yieldgate-requested-tier"] == "standard"
    assert follow.usage.input_tokens > first.parse().usage.input_tokens  # the stored turn is in the prompt
    row = only_row(stack, request_id)
    assert (row["tier"], row["replica"], row["requested_tier"]) == ("fast", "fast-0", "standard")
    assert money(follow.usage.model_extra["cost"]["total"]) == Decimal(row["cost_total"])
    # Recorded in Redis, where other gateways look it up.
    r = redis.Redis.from_url(redis_url)
    assert r.get(f"yg:responses:demo:{first_id}") == b"fast-0"
    r.close()


def test_responses_retrieve_asks_the_replica_that_stored_it(stack, oai):
    stored = oai.responses.create(model="demo:fast", input="Remember the word sage.", max_output_tokens=4)
    request_id = rid("retrieve")
    raw = oai.responses.with_raw_response.retrieve(stored.id, extra_headers={"x-request-id": request_id})
    got = raw.parse()
    # The standard engine never saw it: only routing by the affinity record finds it.
    assert raw.headers["x-yieldgate-replica"] == "fast-0"
    assert (got.id, got.output_text, got.usage.output_tokens) == (stored.id, stored.output_text,
                                                                  stored.usage.output_tokens)
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.retrieve("resp_" + uuid.uuid4().hex)
    assert (exc.value.body["code"], exc.value.body["param"]) == ("response_not_found", "response_id")
    assert ledger_rows(stack, request_id, timeout=1) == []  # a read generates nothing: not billed


def test_unknown_previous_response_id_is_openai_404(stack, oai):
    request_id = rid("unknown-prev")
    with pytest.raises(openai.NotFoundError) as exc:
        oai.responses.create(model="demo", input="again", previous_response_id="resp_" + uuid.uuid4().hex,
                             extra_headers={"x-request-id": request_id})
    err = exc.value.body
    assert (err["code"], err["param"], err["type"]) == \
        ("previous_response_not_found", "previous_response_id", "invalid_request_error")
    assert ledger_rows(stack, request_id, timeout=1) == []  # refused before it was admitted: nothing billed


def _second_gateway(gateway_factory, stack, redis_url, tmp_path, replicas):
    config = Config(server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path / "data"), ledger=False),
                    fleet=FleetConfig(model=stack.model, replicas=replicas, health_interval_s=0.5))
    gw = gateway_factory(config)
    deadline = time.monotonic() + 30
    while http_status(gw.url + "/readyz") != 200:
        assert time.monotonic() < deadline, "second gateway not ready"
        time.sleep(0.2)
    return openai.OpenAI(base_url=gw.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_another_gateway_follows_the_record_and_404s_when_the_replica_is_gone(
        stack, oai, redis_url, gateway_factory, tmp_path):
    stored = oai.responses.create(model="demo:fast", input="Remember the word plum.", max_output_tokens=3).id
    # This gateway's standard tier has both engines: routing alone could send a follow-up to either.
    both = [ReplicaConfig(name="standard-0", tier="standard", url=stack.engines["standard"]),
            ReplicaConfig(name="fast-0", tier="standard", url=stack.engines["fast"])]
    other = _second_gateway(gateway_factory, stack, redis_url, tmp_path / "a", both)
    for _ in range(3):
        raw = other.responses.with_raw_response.create(model="demo", input="Which?", max_output_tokens=3,
                                                       previous_response_id=stored)
        assert raw.status_code == 200 and raw.headers["x-yieldgate-replica"] == "fast-0"
    # A gateway whose fleet no longer has fast-0: the stored response is gone with it.
    without_fast = _second_gateway(gateway_factory, stack, redis_url, tmp_path / "b", both[:1])
    with pytest.raises(openai.NotFoundError) as exc:
        without_fast.responses.create(model="demo", input="Which?", max_output_tokens=3,
                                      previous_response_id=stored)
    assert exc.value.body["code"] == "previous_response_not_found" and "fast-0" in exc.value.body["message"]


@pytest.mark.parametrize("body, param", [
    ({"model": "demo", "input": 5}, "input"),
    ({"model": "demo", "input": []}, "input"),
    ({"model": "demo"}, "input"),
    ({"model": "demo", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "demo", "input": "x", "max_output_tokens": 10**6}, "max_output_tokens"),
    ({"model": "demo", "input": "x", "background": True}, "background"),
    ({"model": "demo", "input": "x", "service_tier": "turbo"}, "service_tier"),
    ({"model": "demo", "input": "x", "previous_response_id": 7}, "previous_response_id"),
])
def test_responses_bad_input_is_an_openai_400(stack, body, param):
    resp = httpx.post(stack.base_url + "/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_models_retrieve(stack, oai):
    assert oai.models.retrieve("demo").id == "demo"
    assert oai.models.retrieve("demo:fast").id == "demo:fast"
    with pytest.raises(openai.NotFoundError) as exc:
        oai.models.retrieve("no-such-model")
    assert exc.value.body["code"] == "model_not_found"


# -- Anthropic Messages ----------------------------------------------------------------------------


def test_messages_unary_cost_is_the_ledger_cost(stack, claude):
    messages = [{"role": "user", "content": "Which file holds the proxy?"}]
    for attempt in range(2):
        request_id = rid("msg")
        raw = claude.messages.with_raw_response.create(
            model="demo", system=INSTRUCTIONS, messages=messages, max_tokens=5,
            extra_headers={"x-request-id": request_id, "anthropic-beta": "made-up-feature-2099-01-01"})
        msg = raw.parse()
        u = msg.usage
        row = only_row(stack, request_id)
        assert (row["status"], row["tier"]) == ("ok", "standard")
        # Anthropic's input_tokens is the uncached part; the ledger's prompt is all of it.
        assert (int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["completion_tokens"])) == \
            (u.input_tokens + u.cache_read_input_tokens + (u.cache_creation_input_tokens or 0),
             u.cache_read_input_tokens, u.output_tokens)
        assert money(u.model_extra["cost"]["total"]) == Decimal(row["cost_total"]) == \
            Decimal(raw.headers["x-yieldgate-cost-usd"])
        # vLLM's Messages route has no ignore_eos: the random demo model may end before any text.
        assert u.service_tier == "standard" and [b.type for b in msg.content] in (["text"], [])
        assert msg.content or msg.stop_reason == "end_turn"
    assert u.cache_read_input_tokens > 0


def test_messages_stream_bills_once_from_message_delta(stack, claude):
    request_id = rid("msg-stream")
    with claude.messages.stream(model="demo:fast", max_tokens=6, messages=[{"role": "user", "content": "Hi"}],
                                extra_headers={"x-request-id": request_id}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    start = next(e for e in events if e.type == "message_start")
    delta = next(e for e in events if e.type == "message_delta")
    assert events[-1].type == "message_stop" and final.usage.output_tokens == delta.usage.output_tokens
    # All 6 tokens unless the model sampled its end of sequence (vLLM's Messages route has no ignore_eos).
    assert final.usage.output_tokens == 6 or final.stop_reason == "end_turn"
    assert start.message.usage.input_tokens > 0
    row = only_row(stack, request_id)
    assert (row["status"], row["tier"], row["replica"]) == ("ok", "fast", "fast-0")
    assert (int(row["prompt_tokens"]), int(row["completion_tokens"])) == \
        (delta.usage.input_tokens + delta.usage.cache_read_input_tokens, delta.usage.output_tokens)
    assert money(delta.usage.model_extra["cost"]["total"]) == Decimal(row["cost_total"]) > 0
    assert delta.usage.service_tier == "priority"


def test_count_tokens_matches_the_prompt_and_is_not_billed(stack, claude):
    messages = [{"role": "user", "content": "How many tokens is this?"}]
    request_id = rid("count")
    counted = claude.messages.count_tokens(model="demo", messages=messages,
                                           extra_headers={"x-request-id": request_id})
    used = claude.messages.create(model="demo", messages=messages, max_tokens=2).usage
    assert counted.input_tokens == used.input_tokens + used.cache_read_input_tokens > 0
    assert ledger_rows(stack, request_id, timeout=1) == []


def test_x_api_key_authenticates_and_budgets_apply(stack):
    admin = {"authorization": f"Bearer {stack.admin_token}"}
    created = httpx.post(stack.gateway_url + "/admin/keys", headers=admin, timeout=30,
                         json={"team": "agents", "name": "claude-code", "budget_usd": "0.0001"})
    assert created.status_code == 201, created.text
    key_id, secret = created.json()["key"]["id"], created.json()["secret"]
    keyed = anthropic.Anthropic(base_url=stack.gateway_url, api_key=secret, max_retries=0, timeout=120)
    request_id = rid("keyed")
    keyed.messages.create(model="demo", max_tokens=4, messages=[{"role": "user", "content": "Hi"}],
                          extra_headers={"x-request-id": request_id})
    assert only_row(stack, request_id)["key_id"] == key_id  # the key came in x-api-key
    # The reservation of the next request's maximum cost does not fit the budget that is left.
    with pytest.raises(anthropic.RateLimitError) as exc:
        keyed.messages.create(model="demo", max_tokens=4000, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["type"] == "error" and exc.value.body["error"]["type"] == "rate_limit_error"
    bogus = anthropic.Anthropic(base_url=stack.gateway_url, api_key="yg-not-a-key", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as exc:
        bogus.messages.create(model="demo", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize("path, body, status, type_", [
    ("/v1/messages", b"{not json", 400, "invalid_request_error"),
    ("/v1/messages", {"model": "demo", "max_tokens": 3, "messages": []}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": "demo", "messages": [{"role": "user", "content": "x"}]}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": "demo", "max_tokens": 3, "messages": [{"role": "robot", "content": "x"}]}, 400,
     "invalid_request_error"),
    ("/v1/messages", {"model": "demo", "max_tokens": 3, "service_tier": "turbo",
                      "messages": [{"role": "user", "content": "x"}]}, 400, "invalid_request_error"),
    ("/v1/messages", {"model": "nope", "max_tokens": 3, "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
    ("/v1/messages/count_tokens", {"model": "demo", "messages": "x"}, 400, "invalid_request_error"),
    ("/v1/messages/count_tokens", {"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404,
     "not_found_error"),
])
def test_messages_bad_input_is_an_anthropic_error(stack, path, body, status, type_):
    headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01", "content-type": "application/json"}
    content = body if isinstance(body, bytes) else None
    resp = httpx.post(stack.gateway_url + path, content=content, json=None if content else body,
                      headers=headers, timeout=30)
    assert resp.status_code == status, resp.text
    payload = resp.json()
    assert payload["type"] == "error" and payload["error"]["type"] == type_ and payload["error"]["message"]
    assert set(payload) == {"type", "error"}
