"""The Batch API and the flex lane on the demo stack, through the official openai client: a job runs
to `completed` with one answer per custom_id, billed at the batch price (half the standard one) in
the ledger; files and batches are private to their key; bad input gets OpenAI-shaped errors."""

from __future__ import annotations

import csv
import io
import json
import time
from decimal import Decimal

import httpx
import openai
import pytest

from yieldgate.pricing import PriceBook
from yieldgate.pricing import Usage as PricedUsage

# Long enough to fill several KV blocks: the lines after the first find it in the engine's cache.
SYSTEM = ("You are a terse assistant for a team of accountants. Answer in one short sentence, always in "
          "English, without any preamble, apology or explanation of your reasoning. Numbers are written "
          "with digits, never spelled out; currencies use their ISO code after the amount. When a question "
          "is ambiguous, answer the most common reading of it and say nothing about the others. ") * 2


def jsonl(lines: list[dict | str]) -> bytes:
    return "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines).encode()


def chat_line(custom_id: str, question: str, max_tokens: int = 6) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "demo", "max_tokens": max_tokens, "temperature": 0,
                     "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}}


def wait_done(client: openai.OpenAI, batch_id: str, timeout_s: float = 240):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "cancelled", "expired"):
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.5)


def read_jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines() if line]


def ledger_rows(admin: httpx.Client, batch_id: str, timeout_s: float = 30) -> list[dict]:
    """The batch's rows in the ledger (flushed by the job's close)."""
    resp = admin.get("/admin/ledger.csv")
    resp.raise_for_status()
    return [r for r in csv.DictReader(io.StringIO(resp.text)) if r["batch_id"] == batch_id]


@pytest.fixture(scope="module")
def keys(admin) -> dict[str, str]:
    out = {}
    for name, spec in (("owner", {"team": "batch"}), ("other", {"team": "batch"}),
                       ("broke", {"team": "batch", "budget_usd": "0"})):
        resp = admin.post("/admin/keys", json=spec)
        assert resp.status_code == 201, resp.text
        out[name] = resp.json()["secret"]
    return out


@pytest.fixture(scope="module")
def owner(stack, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=keys["owner"], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def other(stack, keys) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=keys["other"], max_retries=0, timeout=60)


def test_a_batch_runs_to_completed_with_one_answer_per_line_at_half_the_standard_price(owner, admin):
    questions = {f"q-{i}": f"What is {i} plus {i}?" for i in range(12)}
    lines: list[dict | str] = [chat_line(cid, q) for cid, q in questions.items()]
    lines.insert(5, "{this is not json")
    lines.append({"custom_id": "wrong-url", "method": "POST", "url": "/v1/completions",
                  "body": {"model": "demo", "prompt": "x"}})
    lines.append(chat_line("bad-body", "hi") | {"body": {"model": "demo", "messages": "not a list"}})
    uploaded = owner.files.create(file=("questions.jsonl", jsonl(lines)), purpose="batch")
    assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
    assert owner.files.retrieve(uploaded.id).filename == "questions.jsonl"
    assert owner.files.content(uploaded.id).content == jsonl(lines)

    batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h", metadata={"job": "sums"})
    assert batch.status == "in_progress" and batch.request_counts.total == 15
    batch = wait_done(owner, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (12, 3)
    assert batch.metadata == {"job": "sums"}

    output = read_jsonl(owner, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(questions)  # each answered once
    for o in output:
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200 and o["error"] is None
        assert body["choices"][0]["message"]["content"]
        assert o["response"]["request_id"] == o["id"]
    errors = {e["custom_id"]: e for e in read_jsonl(owner, batch.error_file_id)}
    assert errors[None]["error"]["code"] == "invalid_json_line"
    assert errors["wrong-url"]["error"]["code"] == "invalid_request"
    assert errors["bad-body"]["response"]["status_code"] == 400  # the route's own 400, as a line
    assert errors["bad-body"]["response"]["body"]["error"]["param"] == "messages"

    # The ledger: one record per answered line, carrying the batch id, at half the standard price.
    rows = ledger_rows(admin, batch.id)
    ok = {r["request_id"]: r for r in rows if r["status"] == "ok"}
    assert sorted(ok) == sorted(o["response"]["request_id"] for o in output)
    assert len([r for r in rows if r["status"] == "ok"]) == len(ok)  # none twice
    book = PriceBook()
    for o in output:
        r = ok[o["response"]["request_id"]]
        assert r["tier"] == "batch"
        usage = PricedUsage(int(r["prompt_tokens"]), int(r["cached_tokens"]), int(r["completion_tokens"]))
        standard = book.cost("demo", "standard", usage).total
        assert Decimal(r["cost_total"]) == standard / 2 == book.cost("demo", "batch", usage).total
        assert Decimal(str(o["response"]["body"]["usage"]["cost"]["total"])) == Decimal(r["cost_total"])
    # The job shares a system prompt: lines after the first ones find it in the engines' cache.
    assert sum(int(r["cached_tokens"]) for r in ok.values()) > 0

    spend = admin.get("/admin/spend", params={"group_by": "batch_id"}).json()
    row = next(r for r in spend["rows"] if r["group"]["batch_id"] == batch.id)
    assert row["requests"] == len(rows)
    assert Decimal(str(row["cost_total"])) == sum(Decimal(r["cost_total"]) for r in rows)


def test_a_line_over_budget_is_an_error_line_and_the_job_completes(stack, keys):
    broke = openai.OpenAI(base_url=stack.base_url, api_key=keys["broke"], max_retries=0, timeout=60)
    uploaded = broke.files.create(file=("b.jsonl", jsonl([chat_line(f"b{i}", "hello") for i in range(3)])),
                                  purpose="batch")
    batch = wait_done(broke, broke.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                  completion_window="24h").id)
    assert batch.status == "completed" and batch.output_file_id is None
    errors = read_jsonl(broke, batch.error_file_id)
    assert sorted(e["custom_id"] for e in errors) == ["b0", "b1", "b2"]
    assert {(e["response"]["status_code"], e["response"]["body"]["error"]["code"]) for e in errors} \
        == {(429, "insufficient_quota")}


def test_files_and_batches_are_private_to_their_key_and_errors_are_openai_shaped(stack, owner, other, admin):
    mine = owner.files.create(file=("m.jsonl", jsonl([chat_line("m0", "hi")])), purpose="batch")
    with pytest.raises(openai.NotFoundError):
        other.files.retrieve(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(mine.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert mine.id not in [f.id for f in other.files.list()]
    assert admin.get(f"/v1/files/{mine.id}").json()["id"] == mine.id  # the admin sees every key's
    with pytest.raises(openai.NotFoundError):
        owner.batches.retrieve("batch_doesnotexist")
    with pytest.raises(openai.NotFoundError):
        owner.batches.cancel("batch_doesnotexist")

    def refused(exc_info, param: str) -> None:
        assert exc_info.value.status_code == 400
        assert exc_info.value.body["param"] == param  # OpenAI's error object

    with pytest.raises(openai.BadRequestError) as bad:
        owner.files.create(file=("m.jsonl", b"{}\n"), purpose="fine-tune")
    refused(bad, "purpose")
    with pytest.raises(openai.BadRequestError) as bad:
        owner.batches.create(input_file_id=mine.id, endpoint="/v1/embeddings", completion_window="24h")
    refused(bad, "endpoint")
    with pytest.raises(openai.BadRequestError) as bad:
        owner.batches.create(input_file_id=mine.id, endpoint="/v1/chat/completions", completion_window="1h")
    refused(bad, "completion_window")
    dup = owner.files.create(file=("d.jsonl", jsonl([chat_line("same", "a"), chat_line("same", "b")])), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad:
        owner.batches.create(input_file_id=dup.id, endpoint="/v1/chat/completions", completion_window="24h")
    refused(bad, "input_file_id")
    empty = owner.files.create(file=("e.jsonl", b"\n\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as bad:
        owner.batches.create(input_file_id=empty.id, endpoint="/v1/chat/completions", completion_window="24h")
    refused(bad, "input_file_id")
    assert dup.id not in [b.input_file_id for b in owner.batches.list()]  # nothing left of a refused job

    # No credential at all: 401, in OpenAI's shape.
    anonymous = httpx.get(stack.gateway_url + "/v1/batches", timeout=10)
    assert anonymous.status_code == 401 and anonymous.json()["error"]["type"] == "authentication_error"

    deleted = owner.files.delete(empty.id)
    assert deleted.deleted and deleted.id == empty.id
    with pytest.raises(openai.NotFoundError):
        owner.files.retrieve(empty.id)


def test_flex_is_answered_as_flex_at_the_flex_price(owner, admin):
    answer = owner.chat.completions.with_raw_response.create(
        model="demo", max_tokens=4, service_tier="flex", messages=[{"role": "user", "content": "flex hello"}])
    completion = answer.parse()
    assert completion.service_tier == "flex"
    assert answer.headers["x-yieldgate-priced-tier"] == "flex"
    request_id = answer.headers["x-request-id"]
    admin.get("/admin/spend")  # flushes the ledger
    rows = list(csv.DictReader(io.StringIO(admin.get("/admin/ledger.csv").text)))
    row = next(r for r in rows if r["request_id"] == request_id)
    usage = PricedUsage(int(row["prompt_tokens"]), int(row["cached_tokens"]), int(row["completion_tokens"]))
    assert row["tier"] == "flex"
    assert Decimal(row["cost_total"]) == PriceBook().cost("demo", "standard", usage).total / 2


@pytest.mark.parametrize("endpoint, body, text", [
    ("/v1/completions", {"model": "demo", "max_tokens": 4, "prompt": "Once upon a time"},
     lambda b: b["choices"][0]["text"]),
    ("/v1/responses", {"model": "demo", "max_output_tokens": 4, "input": "Say hello."},
     lambda b: b["output"][-1]["content"][0]["text"]),
])
def test_completions_and_responses_lines_run_too(owner, admin, endpoint, body, text):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": body} for i in range(2)]
    uploaded = owner.files.create(file=("c.jsonl", jsonl(lines)), purpose="batch")
    batch = wait_done(owner, owner.batches.create(input_file_id=uploaded.id, endpoint=endpoint,
                                                  completion_window="24h").id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    output = read_jsonl(owner, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == ["c0", "c1"]
    assert all(isinstance(text(o["response"]["body"]), str) for o in output)
    rows = [r for r in ledger_rows(admin, batch.id) if r["status"] == "ok"]
    assert len(rows) == 2 and {r["route"] for r in rows} == {"completions" if "compl" in endpoint else "responses"}
