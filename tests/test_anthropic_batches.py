"""Anthropic's Message Batches API on the demo stack, through the official anthropic client: a batch
runs to `ended` with one result per custom_id, each answered line billed once in the ledger at the
batch price with the batch's id; batches are private to their key; a bad request refuses the whole
batch with a 400 naming it; cancel, delete and list behave as Anthropic's do."""

from __future__ import annotations

import csv
import io
import time
from decimal import Decimal

import anthropic
import httpx
import openai
import pytest

from yieldgate.pricing import PriceBook
from yieldgate.pricing import Usage as PricedUsage

# Long enough to fill several KV blocks: the requests after the first find it in the engine's cache.
SYSTEM = ("You are a terse assistant for a team of accountants. Answer in one short sentence, always in "
          "English, without any preamble, apology or explanation of your reasoning. Numbers are written "
          "with digits, never spelled out; currencies use their ISO code after the amount. ") * 3


def request(custom_id: str, question: str, max_tokens: int = 6, **params) -> dict:
    return {"custom_id": custom_id,
            "params": {"model": "demo", "max_tokens": max_tokens, "temperature": 0, "system": SYSTEM,
                       "messages": [{"role": "user", "content": question}]} | params}


def wait_ended(client: anthropic.Anthropic, batch_id: str, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.messages.batches.retrieve(batch_id)
        if batch.processing_status == "ended":
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.processing_status}: {batch.request_counts}"
        time.sleep(0.5)


def ledger_rows(admin: httpx.Client, batch_id: str) -> list[dict]:
    resp = admin.get("/admin/ledger.csv")
    resp.raise_for_status()
    return [r for r in csv.DictReader(io.StringIO(resp.text)) if r["batch_id"] == batch_id]


@pytest.fixture(scope="module")
def keys(admin) -> dict[str, str]:
    out = {}
    for name in ("owner", "other"):
        resp = admin.post("/admin/keys", json={"team": "message-batches"})
        assert resp.status_code == 201, resp.text
        out[name] = resp.json()["secret"]
    return out


@pytest.fixture(scope="module")
def owner(stack, keys) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=keys["owner"], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def other(stack, keys) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=stack.gateway_url, api_key=keys["other"], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def ended(owner) -> anthropic.types.messages.MessageBatch:
    """A batch of questions and one request for a model the gateway does not serve, run to its end."""
    requests = [request(f"q-{i}", f"What is {i} plus {i}?") for i in range(8)]
    requests.append(request("no-model", "hi", model="no-such-model"))
    batch = owner.messages.batches.create(requests=requests)
    assert batch.id.startswith("msgbatch_") and batch.type == "message_batch"
    assert batch.processing_status == "in_progress" and batch.results_url is None
    assert batch.request_counts.processing == 9
    assert batch.expires_at.timestamp() - batch.created_at.timestamp() == pytest.approx(24 * 3600, abs=1)
    return wait_ended(owner, batch.id)


def test_a_batch_ends_with_one_result_per_request_billed_once_at_the_batch_price(owner, admin, ended):
    counts = ended.request_counts
    assert (counts.processing, counts.succeeded, counts.errored, counts.canceled, counts.expired) == (0, 8, 1, 0, 0)
    assert ended.ended_at is not None and ended.ended_at >= ended.created_at
    assert ended.cancel_initiated_at is None and ended.archived_at is None
    assert ended.results_url.endswith(f"/v1/messages/batches/{ended.id}/results")

    results = {r.custom_id: r for r in owner.messages.batches.results(ended.id)}
    assert sorted(results) == sorted([f"q-{i}" for i in range(8)] + ["no-model"])  # each once
    succeeded = [r for r in results.values() if r.result.type == "succeeded"]
    assert len(succeeded) == 8
    for r in succeeded:
        message = r.result.message
        assert message.type == "message" and message.role == "assistant" and message.content[0].text
        assert message.usage.service_tier == "batch"
    errored = results["no-model"].result
    assert errored.type == "errored" and errored.error.type == "error"
    assert errored.error.error.type == "not_found_error" and errored.error.request_id

    # The ledger: one record per succeeded request, carrying the batch id, at half the standard price,
    # the cost each message's usage shows; the request for no model is not billed.
    rows = ledger_rows(admin, ended.id)
    assert len(rows) == 8 and {(r["status"], r["tier"], r["route"]) for r in rows} == {("ok", "batch", "messages")}
    assert len({r["request_id"] for r in rows}) == 8
    book = PriceBook()
    billed = []
    for r in rows:
        usage = PricedUsage(int(r["prompt_tokens"]), int(r["cached_tokens"]), int(r["completion_tokens"]))
        assert Decimal(r["cost_total"]) == book.cost("demo", "standard", usage).total / 2 \
            == book.cost("demo", "batch", usage).total
        billed.append((int(r["prompt_tokens"]), int(r["completion_tokens"]), Decimal(r["cost_total"])))
    shown = []
    for r in succeeded:
        usage = r.to_dict()["result"]["message"]["usage"]
        prompt = usage["input_tokens"] + usage["cache_read_input_tokens"] + (usage.get("cache_creation_input_tokens")
                                                                             or 0)
        shown.append((prompt, usage["output_tokens"], Decimal(str(usage["cost"]["total"]))))
    assert sorted(billed) == sorted(shown)
    # The batch shares a system prompt: requests after the first ones find it in the engines' cache.
    assert sum(int(r["cached_tokens"]) for r in rows) > 0


def test_a_batch_is_its_keys_alone(stack, owner, other, admin, keys, ended):
    for call in (other.messages.batches.retrieve, other.messages.batches.cancel, other.messages.batches.delete):
        with pytest.raises(anthropic.NotFoundError) as nf:
            call(ended.id)
        assert nf.value.body["error"]["type"] == "not_found_error"
    theirs = httpx.get(ended.results_url, headers={"x-api-key": keys["other"]}, timeout=30)
    assert theirs.status_code == 404 and theirs.json()["error"]["type"] == "not_found_error"
    assert ended.id not in [b.id for b in other.messages.batches.list()]
    assert ended.id in [b.id for b in owner.messages.batches.list()]
    # The admin credential sees every key's; OpenAI's Batch API does not see message batches.
    assert admin.get(f"/v1/messages/batches/{ended.id}").json()["id"] == ended.id
    openai_client = openai.OpenAI(base_url=stack.base_url, api_key=keys["owner"], max_retries=0)
    with pytest.raises(openai.NotFoundError):
        openai_client.batches.retrieve(ended.id)
    assert ended.id not in [b.id for b in openai_client.batches.list()]
    # A bearer token works as x-api-key does; none at all is a 401 in Anthropic's shape.
    bearer = httpx.get(f"{stack.gateway_url}/v1/messages/batches/{ended.id}",
                       headers={"authorization": f"Bearer {keys['owner']}"}, timeout=30)
    assert bearer.status_code == 200 and bearer.json()["id"] == ended.id
    anonymous = httpx.get(f"{stack.gateway_url}/v1/messages/batches", timeout=30)
    assert anonymous.status_code == 401
    assert anonymous.json() == {"type": "error", "error": {"type": "authentication_error",
                                                           "message": anonymous.json()["error"]["message"]}}


def test_a_bad_request_refuses_the_batch_naming_it(owner):
    before = [b.id for b in owner.messages.batches.list(limit=1000)]

    def refused(requests: list[dict], *names: str) -> None:
        with pytest.raises(anthropic.BadRequestError) as bad:
            owner.messages.batches.create(requests=requests)
        assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
        for name in names:
            assert name in bad.value.body["error"]["message"], bad.value.body

    no_max_tokens = request("b", "hi")
    del no_max_tokens["params"]["max_tokens"]
    refused([request("a", "hi"), no_max_tokens], "requests.1", "'b'", "max_tokens")
    refused([request("a", "hi"), request("a", "again")], "requests.1", "custom_id")
    refused([request("a", "hi", stream=True)], "requests.0", "stream")
    refused([request("a", "hi", max_tokens=10**6)], "requests.0", "max_tokens")
    refused([request("not ok!", "hi")], "requests[0].custom_id")
    refused([], "requests")
    assert [b.id for b in owner.messages.batches.list(limit=1000)] == before  # nothing kept of any


def test_cancel_ends_a_batch_and_bills_only_what_ran_then_delete(owner, admin):
    requests = [request(f"c-{i}", f"Count slowly from {i} to {i + 40}.", max_tokens=48) for i in range(24)]
    batch = owner.messages.batches.create(requests=requests)
    with pytest.raises(anthropic.BadRequestError):  # still processing: not yet
        owner.messages.batches.delete(batch.id)
    canceling = owner.messages.batches.cancel(batch.id)
    assert canceling.processing_status in ("canceling", "ended") and canceling.cancel_initiated_at is not None
    batch = wait_ended(owner, batch.id, timeout_s=60)  # within a few worker polls, whatever max_tokens
    counts = batch.request_counts
    assert counts.canceled >= 1 and counts.processing == 0
    assert counts.succeeded + counts.errored + counts.canceled == 24 and counts.expired == 0

    results = list(owner.messages.batches.results(batch.id))
    assert sorted(r.custom_id for r in results) == sorted(r["custom_id"] for r in requests)
    by_type = {t: sum(r.result.type == t for r in results) for t in ("succeeded", "errored", "canceled")}
    assert by_type == {"succeeded": counts.succeeded, "errored": counts.errored, "canceled": counts.canceled}
    rows = ledger_rows(admin, batch.id)  # a request cut off by the cancel is not billed
    assert len(rows) == counts.succeeded and all(r["tier"] == "batch" for r in rows)

    with pytest.raises(anthropic.BadRequestError):  # nothing left to cancel
        owner.messages.batches.cancel(batch.id)
    deleted = owner.messages.batches.delete(batch.id)
    assert deleted.id == batch.id and deleted.type == "message_batch_deleted"
    with pytest.raises(anthropic.NotFoundError):
        owner.messages.batches.retrieve(batch.id)
    assert batch.id not in [b.id for b in owner.messages.batches.list(limit=1000)]
    assert len(ledger_rows(admin, batch.id)) == counts.succeeded  # the bill stays


def test_list_pages_newest_first_both_ways(stack, keys):
    client = anthropic.Anthropic(base_url=stack.gateway_url, api_key=keys["other"], max_retries=0, timeout=60)
    made = [client.messages.batches.create(requests=[request("x", "hi", max_tokens=1)]).id for _ in range(3)]
    newest_first = [b.id for b in client.messages.batches.list(limit=1000)]
    assert newest_first[:3] == made[::-1]
    assert [b.id for b in client.messages.batches.list(limit=1)] == newest_first  # after_id pages, one by one
    page = client.messages.batches.list(limit=1)
    assert page.has_more and page.first_id == page.last_id == newest_first[0]
    newer = client.messages.batches.list(before_id=newest_first[-1], limit=2)
    assert [b.id for b in newer.data] == newest_first[-3:-1] and newer.has_more == (len(newest_first) > 3)
    assert client.messages.batches.list(before_id=newest_first[0]).data == []
    with pytest.raises(anthropic.BadRequestError):
        client.messages.batches.list(limit=0)
    for batch_id in made:
        wait_ended(client, batch_id)
