"""Drills of the batch and flex lanes on an engine of the module's own (the demo model, four
sequences at a time, priority scheduling, as `yieldgate up` launches engines), with gateways in
processes of their own sharing one PostgreSQL:

- a gateway SIGKILLed mid-job, another one started: the job completes with every line answered
  once, nothing billed twice, and the ledger equal to the output file;
- a job cancelled mid-way stops within seconds and bills only the lines that ran;
- a flex request on saturated engines gets a 429 with retry-after at once, not a timeout.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import csv
import io
import json
import os
import signal
import time
import uuid
from collections import Counter
from decimal import Decimal

import httpx
import openai
import pytest

from conftest import GATEWAY_PORT
from engines import start_engine, stop_engine, wait_healthy
from pg import temp_database
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import GatewayProcess
from yieldgate.serving.config import FleetConfig, ReplicaConfig

HOST = "127.0.12.1"
ENGINE_PORT = GATEWAY_PORT + 150
ADMIN = "batch-drill-" + uuid.uuid4().hex[:8]
PEPPER = uuid.uuid4().hex


@pytest.fixture(scope="module")
def engine(tmp_path_factory) -> str:
    from yieldgate.serving.demo_model import ensure_demo_model

    log = tmp_path_factory.mktemp("batch-engine") / "engine.log"
    proc = start_engine(ensure_demo_model(), ENGINE_PORT, log, "--enable-prefix-caching",
                        "--enable-prompt-tokens-details", "--scheduling-policy", "priority",
                        "--max-num-seqs", "4", plugin=False, host=HOST)
    url = f"http://{HOST}:{ENGINE_PORT}"
    try:
        wait_healthy(url, proc, log)
        yield url
    finally:
        stop_engine(proc)


@pytest.fixture(scope="module")
def postgres_url() -> str:
    with temp_database() as url:
        yield url


@pytest.fixture
def gateways(tmp_path, engine, postgres_url, gateway_process_factory):
    """Start gateway processes on the drill's engine and PostgreSQL; each its own data dir."""
    redis_url = f"redis://127.0.0.1:6379/{os.environ.get('YIELDGATE_TEST_DRILL_REDIS_DB', '14')}"

    def start(**lanes) -> GatewayProcess:
        config = Config(
            server=ServerConfig(host=HOST, admin_token=ADMIN, redis_url=redis_url, postgres_url=postgres_url,
                                data_dir=str(tmp_path / f"data-{uuid.uuid4().hex[:8]}")),
            fleet=FleetConfig(model="demo", health_interval_s=0.5, replicas=[
                ReplicaConfig(name="std", tier="standard", url=engine)]))
        config.pricing.ledger.store = "postgres"
        config.pricing.limits.redis_url = redis_url
        config.pricing.limits.key_pepper = PEPPER  # gateways of one fleet share it (docs/deployment.md)
        for name, value in ({"batch_lease_s": 2.0, "batch_poll_s": 0.2, "batch_lines_per_replica": 2} | lanes).items():
            setattr(config.lanes, name, value)
        return gateway_process_factory(config)

    return start


def admin(gw: GatewayProcess) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60)


def client_for(gw: GatewayProcess) -> openai.OpenAI:
    with admin(gw) as a:
        resp = a.post("/admin/keys", json={"team": "drill"})
    assert resp.status_code == 201, resp.text
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=resp.json()["secret"], max_retries=2, timeout=60)


def submit(client: openai.OpenAI, n: int, max_tokens: int) -> str:
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "demo", "max_tokens": max_tokens, "ignore_eos": True,
                       "messages": [{"role": "system", "content": "Summarise the ticket in one line."},
                                    {"role": "user", "content": f"Ticket {i}: the printer on floor {i % 7} jams."}]}}
             for i in range(n)]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = client.files.create(file=("drill.jsonl", data), purpose="batch")
    return client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def wait_for(client: openai.OpenAI, batch_id: str, done, timeout_s: float = 300):
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"batch {batch.status}: {batch.request_counts}"
        time.sleep(0.2)


def finished(batch) -> bool:
    return batch.status in ("completed", "failed", "cancelled", "expired")


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines() if x]


def ledger_of(gw: GatewayProcess, batch_id: str) -> list[dict]:
    with admin(gw) as a:
        text = a.get("/admin/ledger.csv").text
    return [r for r in csv.DictReader(io.StringIO(text)) if r["batch_id"] == batch_id]


def reconcile(gw: GatewayProcess, batch_id: str, output: list[dict]) -> None:
    """Ledger = output file: one record per answered line, none twice, none for anything else,
    and the same money to the last digit."""
    rows = ledger_of(gw, batch_id)
    billed = Counter(r["request_id"] for r in rows if Decimal(r["cost_total"]) > 0)
    answered = {o["response"]["request_id"]: o for o in output}
    assert [rid for rid, n in billed.items() if n > 1] == [], "a line billed twice"
    assert sorted(billed) == sorted(answered), "the ledger and the output file disagree"
    ledger_total = sum(Decimal(r["cost_total"]) for r in rows)
    output_total = sum(Decimal(str(o["response"]["body"]["usage"]["cost"]["total"])) for o in answered.values())
    assert ledger_total == output_total


def reclaimed_lines(postgres_url: str, batch_id: str) -> int:
    import asyncpg

    async def count() -> int:
        conn = await asyncpg.connect(postgres_url)
        try:
            return await conn.fetchval("SELECT count(*) FROM yg_batch_line WHERE batch_id = $1 AND attempts > 1",
                                       batch_id)
        finally:
            await conn.close()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, count()).result()


def test_a_gateway_sigkilled_mid_job_loses_no_line_and_bills_none_twice(gateways, postgres_url):
    first = gateways()
    client = client_for(first)
    total = 40
    batch_id = submit(client, total, max_tokens=48)
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 6)
    os.kill(first.process.pid, signal.SIGKILL)  # lines in flight, records perhaps only in its journal
    first.process.wait(10)

    second = gateways()  # another data dir: nothing of the first's journal is replayed
    client = openai.OpenAI(base_url=second.url + "/v1", api_key=client.api_key, max_retries=2, timeout=60)
    batch = wait_for(client, batch_id, finished)
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (total, 0)
    output = lines_of(client, batch.output_file_id)
    assert sorted(o["custom_id"] for o in output) == sorted(f"line-{i}" for i in range(total))  # each once
    assert reclaimed_lines(postgres_url, batch_id) >= 1  # the kill caught lines in flight: run again
    reconcile(second, batch_id, output)


def test_a_cancelled_job_stops_within_seconds_and_bills_only_what_ran(gateways):
    gw = gateways()
    client = client_for(gw)
    total = 60
    batch_id = submit(client, total, max_tokens=64)
    wait_for(client, batch_id, lambda b: b.request_counts.completed >= 3)
    cancelling = client.batches.cancel(batch_id)
    assert cancelling.status in ("cancelling", "cancelled")
    asked = time.monotonic()
    batch = wait_for(client, batch_id, finished, timeout_s=60)
    stopped_s = time.monotonic() - asked
    print(f"\n[batch] cancelled after {batch.request_counts.completed} of {total} lines, in {stopped_s:.1f} s")
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    counts = batch.request_counts
    assert counts.completed + counts.failed == total and 3 <= counts.completed < total
    errors = lines_of(client, batch.error_file_id)
    assert len(errors) == counts.failed and {e["error"]["code"] for e in errors} == {"batch_cancelled"}
    output = lines_of(client, batch.output_file_id)
    assert len(output) == counts.completed
    reconcile(gw, batch_id, output)
    # Nothing runs for the job any more.
    assert client.batches.retrieve(batch_id).request_counts.completed == counts.completed


def test_flex_on_saturated_engines_gets_a_429_with_retry_after_not_a_timeout(gateways):
    gw = gateways(flex_max_waiting=0, flex_retry_after_s=3)
    client = client_for(gw)

    def long_request(i: int) -> int:
        resp = httpx.post(gw.url + "/v1/chat/completions", timeout=120, json={
            "model": "demo", "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": f"interactive {i}"}]})
        return resp.status_code

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        busy = [pool.submit(long_request, i) for i in range(10)]
        with admin(gw) as a:  # the engine's own queue, as the gateway scraped it
            deadline = time.monotonic() + 60
            while a.get("/admin/fleet").json()["std"]["engine_metrics"].get("vllm:num_requests_waiting", 0) < 1:
                assert time.monotonic() < deadline, "the engine never queued a request"
                time.sleep(0.1)
        with pytest.raises(openai.RateLimitError) as refused:
            client.with_options(max_retries=0).chat.completions.create(
                model="demo", max_tokens=4, service_tier="flex", messages=[{"role": "user", "content": "flex"}])
        assert refused.value.response.headers["retry-after"] == "3"
        assert refused.value.body["code"] == "resource_unavailable"
        assert [f.result() for f in busy] == [200] * 10  # interactive requests were all served
    with admin(gw) as a:  # the queue has drained: flex is served again
        deadline = time.monotonic() + 60
        while a.get("/admin/fleet").json()["std"]["engine_metrics"].get("vllm:num_requests_waiting", 0) > 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    answer = client.chat.completions.create(model="demo", max_tokens=4, service_tier="flex",
                                            messages=[{"role": "user", "content": "flex"}])
    assert answer.service_tier == "flex"
