"""`yieldgate loadtest -w agent-tools` through the session stack's gateway in each wire format:
every request the load tester saw is in the ledger once, at the cost the client was shown, and
every turn after the first reads its conversation's prefix from the cache."""

from __future__ import annotations

import csv
import io
import json
import time
from decimal import Decimal

import httpx
import pytest

from tests.test_cli import run


def ledger(stack) -> dict[str, list[dict[str, str]]]:
    resp = httpx.get(stack.gateway_url + "/admin/ledger.csv", timeout=30,
                     headers={"authorization": f"Bearer {stack.admin_token}"})
    resp.raise_for_status()
    rows: dict[str, list[dict[str, str]]] = {}
    for r in csv.DictReader(io.StringIO(resp.text)):
        rows.setdefault(r["request_id"], []).append(r)
    return rows


@pytest.mark.parametrize("api", ["chat", "responses", "messages"])
def test_agent_tools_workload_is_billed_as_seen_and_later_turns_hit_the_cache(stack, tmp_path, api):
    out = run("loadtest", "-t", stack.gateway_url, "-m", stack.model, "-w", "agent-tools", "--api", api,
              "-p", "turns_min=3", "-p", "turns_max=3", "-p", "words_per_token=0.42", "--output-tokens", "8",
              "--requests", "6", "--concurrency", "2", "--cache-salt", "auto", "--no-progress", "--no-html",
              "--out", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # requests.jsonl omits default values (turn 0, no cached tokens).
    records = [{"turn": 0, "cached_tokens": 0, **json.loads(line)}
               for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert len(records) == 6 and all(r["ok"] for r in records), records
    assert {r["turn"] for r in records} == {0, 1, 2} and len({r["session"] for r in records}) == 2
    deadline = time.monotonic() + 20
    while True:  # the ledger writes behind the response
        rows = ledger(stack)
        if all(r["request_id"] in rows for r in records) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for r in records:
        assert r["cost_source"] == "response"
        [row] = rows[r["request_id"]]  # billed exactly once
        assert Decimal(row["cost_total"]) == Decimal(repr(r["cost"])), (row, r)
        assert int(row["prompt_tokens"]) == r["prompt_tokens"]
        assert int(row["cached_tokens"]) == r["cached_tokens"] and row["route"] == api
        if r["turn"] > 0:
            # The system prompt, tools and earlier turns are whole 32-token blocks already computed.
            assert r["cached_tokens"] > 0, r
            assert r["prompt_tokens"] > r["cached_tokens"]
