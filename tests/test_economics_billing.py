"""Every request is priced exactly and recorded once: usage.cost, the cost header, the ledger
(including abandoned streams), feedback → success report, admin reports and the CLI.

An in-process gateway with its own price list and data dir fronts the stack's real engines.
"""

from __future__ import annotations

import csv
import io
import json
import time
import uuid
from decimal import Decimal

import httpx
import openai
import pytest
from typer.testing import CliRunner

from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.pricing import LimitsConfig, PriceBook, PricingConfig, TierPrice, Usage
from yieldgate.serving.config import FleetConfig, ReplicaConfig

ADMIN = "econ-admin-" + uuid.uuid4().hex[:8]
LONG_SYSTEM = ("You are the billing assistant of the yieldgate project; answer briefly. " * 12).strip()


SHARED_PEPPER = "test-pepper-" + uuid.uuid4().hex


def economics_config(stack, tmp_path, redis_url: str, **server) -> Config:
    pricing = PricingConfig(
        fast_min_speedup=0,  # the fast price as listed (the floor: test_fast_price_floor.py)
        models={"demo": {"standard": TierPrice(input=Decimal("0.37"), cached_input=Decimal("0.05"),
                                               output=Decimal("1.13")),
                         "fast": TierPrice(input=Decimal("0.91"))}},
        # Gateways sharing Redis share the key pepper (deployments set it from a secret store).
        limits=LimitsConfig(prefix=f"yg-econ-{uuid.uuid4().hex[:8]}:", key_cache_ttl_s=1.0,
                            key_pepper=SHARED_PEPPER))
    pricing.ledger.flush_interval_s = 0.05
    replicas = [ReplicaConfig(name="standard-0", tier="standard", url=stack.engines["standard"],
                              cost_per_hour="0.40"),
                ReplicaConfig(name="fast-0", tier="fast", url=stack.engines["fast"], cost_per_hour="0.80")]
    return Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(tmp_path / "data"), **server),
        fleet=FleetConfig(model=stack.model, replicas=replicas, health_interval_s=0.5),
        pricing=pricing)


def ledger_rows(url: str) -> list[dict[str, str]]:
    resp = httpx.get(url + "/admin/ledger.csv", headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    resp.raise_for_status()
    return list(csv.DictReader(io.StringIO(resp.text)))


def wait_for_record(url: str, request_id: str, timeout: float = 20) -> list[dict[str, str]]:
    deadline = time.monotonic() + timeout
    while True:
        rows = [r for r in ledger_rows(url) if r["request_id"] == request_id]
        if rows or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


@pytest.fixture(scope="module")
def econ(stack, redis_url, tmp_path_factory):
    from conftest import InProcessGateway

    config = economics_config(stack, tmp_path_factory.mktemp("econ"), redis_url)
    gw = InProcessGateway(config)
    gw.book = PriceBook(config.pricing)
    yield gw
    gw.stop()
    clean_redis(redis_url, config.pricing.limits.prefix)


def clean_redis(url: str, prefix: str) -> None:
    import redis

    r = redis.Redis.from_url(url)
    keys = list(r.scan_iter(match=prefix + "*"))
    if keys:
        r.delete(*keys)
    r.close()


def test_unary_cost_is_exact_price_book_arithmetic(econ):
    client = openai.OpenAI(base_url=econ.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "system", "content": LONG_SYSTEM}, {"role": "user", "content": "Hello?"}]
    for attempt in range(2):  # the second one reads the system prompt from the prefix cache
        raw = client.chat.completions.with_raw_response.create(model="demo", messages=messages, max_tokens=6)
        resp = raw.parse()
        u = resp.usage
        cached = u.prompt_tokens_details.cached_tokens
        expected = econ.book.cost("demo", "standard", Usage(u.prompt_tokens, cached, u.completion_tokens))
        cost = u.model_extra["cost"]
        assert Decimal(repr(cost["total"])) == expected.total
        assert Decimal(repr(cost["uncached_input"])) == expected.uncached_input
        assert Decimal(repr(cost["cached_input"])) == expected.cached_input
        assert Decimal(repr(cost["output"])) == expected.output
        assert raw.headers["x-yieldgate-cost-usd"] == expected.header_value()
    assert cached > 0 and expected.cached_input == Decimal("0.05") * cached / 1_000_000
    # The JSON numbers are the exact Decimals, not float renderings.
    body = httpx.post(econ.url + "/v1/chat/completions", timeout=60, json={
        "model": "demo", "messages": messages, "max_tokens": 3}).content
    usage = json.loads(body, parse_float=Decimal)["usage"]
    exact = econ.book.cost("demo", "standard", Usage(
        usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"], usage["completion_tokens"]))
    assert usage["cost"]["total"] == exact.total


def test_streamed_cost_is_in_the_final_usage_chunk(econ):
    client = openai.OpenAI(base_url=econ.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(
        model="demo:fast", messages=[{"role": "user", "content": "Count to five."}], max_tokens=9,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 9
    expected = econ.book.cost("demo", "fast", Usage(
        usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens, usage.completion_tokens))
    assert Decimal(repr(usage.model_extra["cost"]["total"])) == expected.total
    assert expected.output == Decimal("0.91") * 4 * 9 / 1_000_000  # output derives as 4x input


def test_each_request_is_recorded_once_with_its_dimensions(econ):
    rid = "req-econ-" + uuid.uuid4().hex
    resp = httpx.post(econ.url + "/v1/chat/completions", timeout=60,
                      headers={"x-request-id": rid, "x-session-id": "sess-once"},
                      json={"model": "demo", "messages": [{"role": "user", "content": "once"}], "max_tokens": 4,
                            "ignore_eos": True})  # the random demo model may sample its end of sequence
    assert resp.status_code == 200
    usage = resp.json()["usage"]
    rows = wait_for_record(econ.url, rid)
    assert len(rows) == 1
    r = rows[0]
    assert (r["status"], r["model"], r["tier"], r["replica"], r["weight_version"], r["session_id"]) == \
        ("ok", "demo", "standard", "standard-0", "base", "sess-once")
    assert int(r["prompt_tokens"]) == usage["prompt_tokens"]
    assert int(r["completion_tokens"]) == usage["completion_tokens"] == 4
    assert Decimal(r["cost_total"]) == Decimal(resp.headers["x-yieldgate-cost-usd"])
    assert float(r["latency_ms"]) >= float(r["ttft_ms"]) > 0


def test_abandoned_stream_is_billed_once_as_aborted(econ):
    # Now and then a new stream's first events reach the client only once all 2000 tokens exist (seen
    # right after another stream was abandoned; mostly the engine's first byte comes that late too).
    # A client reading its second event then is not leaving mid-stream: such an attempt (billed `ok`
    # for the whole stream) does not count. A gateway that never notices a client leave fails all three.
    for _ in range(3):
        rid = "req-abandon-" + uuid.uuid4().hex
        started = time.monotonic()
        with httpx.Client(timeout=60) as http:
            with http.stream("POST", econ.url + "/v1/chat/completions", headers={"x-request-id": rid}, json={
                    "model": "demo", "messages": [{"role": "user", "content": "Write a very long story."}],
                    "max_tokens": 2000, "ignore_eos": True, "stream": True}) as resp:
                assert resp.status_code == 200
                events = 0
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if events == 2:
                            break
                left_after_ms = (time.monotonic() - started) * 1000
        rows = wait_for_record(econ.url, rid)
        assert len(rows) == 1
        r = rows[0]
        if not (r["status"] == "ok" and int(r["completion_tokens"]) == 2000):
            break
    assert r["status"] == "aborted", f"left after {left_after_ms:.0f} ms: {r}"
    completion, prompt = int(r["completion_tokens"]), int(r["prompt_tokens"])
    assert 1 <= completion < 2000 and prompt > 0          # tokens relayed so far; prompt estimated
    assert Decimal(r["cost_total"]) == econ.book.cost(
        "demo", "standard", Usage(prompt, int(r["cached_tokens"]), completion)).total > 0
    time.sleep(0.5)
    assert len([x for x in ledger_rows(econ.url) if x["request_id"] == rid]) == 1


def test_feedback_feeds_the_success_report(econ):
    session = "sess-fb-" + uuid.uuid4().hex[:8]
    costs = []
    for i in range(2):
        resp = httpx.post(econ.url + "/v1/chat/completions", timeout=60, headers={"x-session-id": session},
                          json={"model": "demo", "messages": [{"role": "user", "content": f"step {i}"}],
                                "max_tokens": 3})
        costs.append(Decimal(resp.headers["x-yieldgate-cost-usd"]))
    failed = httpx.post(econ.url + "/v1/completions", timeout=60,
                        json={"model": "demo", "prompt": "solve", "max_tokens": 3})
    fb = httpx.post(econ.url + "/v1/feedback", json={"session_id": session, "passed": True}, timeout=10)
    assert fb.status_code == 200 and fb.json()["outcome"]["passed"] is True
    fb = httpx.post(econ.url + "/v1/feedback", json={"request_id": failed.headers["x-request-id"], "score": 0.1})
    assert fb.status_code == 200 and fb.json()["outcome"]["passed"] is False
    bad = httpx.post(econ.url + "/v1/feedback", json={"passed": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
    report = httpx.get(econ.url + "/admin/success", params={"group_by": "session_id"},
                       headers={"authorization": f"Bearer {ADMIN}"}, timeout=30).json()
    row = next(r for r in report["rows"] if r["group"]["session_id"] == session)
    assert (row["tasks_graded"], row["successes"], row["success_rate"]) == (1, 1, 1.0)
    assert Decimal(repr(row["usd_per_success"])) == sum(costs)
    by_version = httpx.get(econ.url + "/admin/success", params={"group_by": "weight_version"},
                           headers={"authorization": f"Bearer {ADMIN}"}).json()
    base = next(r for r in by_version["rows"] if r["group"]["weight_version"] == "base")
    assert base["tasks_graded"] >= 2 and base["successes"] >= 1


def test_spend_csv_rows_are_the_ledger_summed_by_group(econ):
    sessions = {f"sess-csv-{uuid.uuid4().hex[:8]}": n for n in (2, 1)}
    told: dict[str, list[Decimal]] = {}  # session -> the costs the client was told
    ids: list[str] = []
    for session, n in sessions.items():
        for i in range(n):
            resp = httpx.post(econ.url + "/v1/chat/completions", timeout=60, headers={"x-session-id": session},
                              json={"model": "demo", "messages": [{"role": "user", "content": f"csv {i}"}],
                                    "max_tokens": 3 + i})
            assert resp.status_code == 200
            told.setdefault(session, []).append(Decimal(resp.headers["x-yieldgate-cost-usd"]))
            ids.append(resp.headers["x-request-id"])
    for rid in ids:
        assert wait_for_record(econ.url, rid)
    resp = httpx.get(econ.url + "/admin/spend.csv", params={"group_by": "session_id,tier"},
                     headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/csv")
    reader = csv.DictReader(io.StringIO(resp.text))
    sums = ["prompt_tokens", "cached_tokens", "completion_tokens", "cost_uncached_input", "cost_cached_input",
            "cost_output", "cost_total"]
    assert reader.fieldnames == ["session_id", "tier", "requests", "errors", *sums]
    rows = {r["session_id"]: r for r in reader if r["session_id"] in sessions}
    assert set(rows) == set(sessions)
    ledger = ledger_rows(econ.url)
    for session, n in sessions.items():
        mine = [r for r in ledger if r["session_id"] == session]
        row = rows[session]
        assert (row["tier"], int(row["requests"]), int(row["errors"])) == ("standard", n, 0)
        for field in sums:
            assert Decimal(row[field]) == sum(Decimal(r[field]) for r in mine), (session, field)
        assert Decimal(row["cost_total"]) == sum(told[session])


def test_admin_reports_need_the_admin_token(econ):
    for path in ("/admin/keys", "/admin/spend", "/admin/spend.csv", "/admin/yield", "/admin/success",
                 "/admin/cache-advisor", "/admin/ledger.csv"):
        resp = httpx.get(econ.url + path)
        assert resp.status_code == 401, path
        assert resp.json()["error"]["type"] == "authentication_error"
        assert httpx.get(econ.url + path, headers={"authorization": "Bearer nope"}).status_code == 401
    auth = {"authorization": f"Bearer {ADMIN}"}
    spend = httpx.get(econ.url + "/admin/spend", params={"group_by": "tier,model", "since": "2020-01-01"},
                      headers=auth).json()
    assert {r["group"]["tier"] for r in spend["rows"]} >= {"standard", "fast"}
    assert httpx.get(econ.url + "/admin/spend", params={"group_by": "colour"}, headers=auth).status_code == 400
    y = httpx.get(econ.url + "/admin/yield", headers=auth).json()
    tiers = {t["tier"]: t for t in y["tiers"]}
    assert tiers["standard"]["tokens"] > 0 and tiers["standard"]["cost_per_mtok"] > 0
    assert {r["replica"] for r in y["replicas"]} == {"standard-0", "fast-0"}
    metrics = httpx.get(econ.url + "/metrics").text
    for name in ("yieldgate_cost_usd_total", "yieldgate_cache_hit_ratio", "yieldgate_actual_cost_per_mtok_usd",
                 "yieldgate_list_revenue_per_mtok_usd", 'yieldgate_tokens_total{kind="cached"'):
        assert name in metrics


def test_cli_keys_and_spend(econ):
    from yieldgate.gateway.cli import app

    runner = CliRunner()
    opts = ["--url", econ.url, "--admin-token", ADMIN]
    created = runner.invoke(app, ["keys", "create", "--team", "cli-team", "--budget-usd", "2.50", "--rpm", "30", *opts])
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip().splitlines()[-1]
    key_id = secret.split("-")[1]
    resp = httpx.post(econ.url + "/v1/chat/completions", timeout=60, headers={"authorization": f"Bearer {secret}"},
                      json={"model": "demo", "messages": [{"role": "user", "content": "cli"}], "max_tokens": 2})
    assert resp.status_code == 200
    listed = runner.invoke(app, ["keys", "list", "--json", *opts])
    assert listed.exit_code == 0 and key_id in listed.stdout
    spend = runner.invoke(app, ["spend", "--group-by", "key,team", "--since", "1h", "--csv", *opts])
    assert spend.exit_code == 0, spend.output
    rows = {r["key_id"]: r for r in csv.DictReader(io.StringIO(spend.stdout))}
    assert rows[key_id]["team"] == "cli-team"
    assert Decimal(rows[key_id]["cost_total"]) == Decimal(resp.headers["x-yieldgate-cost-usd"])
    revoked = runner.invoke(app, ["keys", "revoke", key_id, *opts])
    assert revoked.exit_code == 0
    again = httpx.post(econ.url + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}"},
                       json={"model": "demo", "messages": [{"role": "user", "content": "cli"}], "max_tokens": 2})
    assert again.status_code == 401 and again.json()["error"]["code"] == "invalid_api_key"
    bad = runner.invoke(app, ["keys", "list", "--url", econ.url, "--admin-token", "wrong"])
    assert bad.exit_code == 1
