"""API keys, rate limits and budgets enforced by real gateways over real Redis and engines,
including one budget shared by two gateways under 50 concurrent requests."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal

import httpx
import pytest

from test_economics_billing import ADMIN, clean_redis, economics_config

from yieldgate.pricing import PriceBook

AUTH = {"authorization": f"Bearer {ADMIN}"}
CHAT = {"model": "demo", "messages": [{"role": "user", "content": "Budget check, please."}], "max_tokens": 4}


def create_key(url: str, **spec) -> tuple[str, str]:
    resp = httpx.post(url + "/admin/keys", json=spec, headers=AUTH, timeout=10)
    assert resp.status_code == 201, resp.text
    return resp.json()["key"]["id"], resp.json()["secret"]


def chat(url: str, secret: str | None, body: dict = CHAT) -> httpx.Response:
    headers = {"authorization": f"Bearer {secret}"} if secret else {}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=headers, timeout=120)


@pytest.fixture
def keyed(stack, redis_url, tmp_path, gateway_factory):
    config = economics_config(stack, tmp_path, redis_url, require_keys=True)
    gw = gateway_factory(config)
    yield gw
    clean_redis(redis_url, config.pricing.limits.prefix)


def test_require_keys_admin_and_api_keys_never_mix(keyed):
    url = keyed.url
    key_id, secret = create_key(url, team="auth")
    for headers, message in (({}, "Missing"), ({"authorization": "Bearer sk-foo"}, "Incorrect"),
                             ({"authorization": f"Bearer {ADMIN}"}, "admin token"),
                             ({"authorization": f"Bearer {secret}x"}, "Incorrect")):
        resp = httpx.post(url + "/v1/chat/completions", json=CHAT, headers=headers, timeout=10)
        assert resp.status_code == 401
        err = resp.json()["error"]
        assert (err["type"], err["code"]) == ("authentication_error", "invalid_api_key")
        assert message in err["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/admin/keys", headers={"authorization": f"Bearer {secret}"}).status_code == 401
    ok = chat(url, secret)
    assert ok.status_code == 200 and "cost" in ok.json()["usage"]
    assert httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {secret}"}).status_code == 200
    assert httpx.post(url + "/v1/feedback", json={"request_id": ok.headers["x-request-id"], "passed": True}
                      ).status_code == 401
    assert httpx.post(url + "/v1/feedback", json={"request_id": ok.headers["x-request-id"], "passed": True},
                      headers={"authorization": f"Bearer {secret}"}).status_code == 200
    revoked = httpx.delete(url + f"/admin/keys/{key_id}", headers=AUTH)
    assert revoked.status_code == 200 and revoked.json()["key"]["revoked"] is True
    after = chat(url, secret)
    assert after.status_code == 401 and "revoked" in after.json()["error"]["message"]
    assert httpx.delete(url + "/admin/keys/nope", headers=AUTH).status_code == 404


def test_rate_limit_is_429_with_retry_after(keyed):
    _, secret = create_key(keyed.url, team="rl", rpm=2)
    assert [chat(keyed.url, secret).status_code for _ in range(2)] == [200, 200]
    limited = chat(keyed.url, secret)
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(limited.headers["retry-after"]) <= 120  # sliding window: up to 2 windows
    metrics = httpx.get(keyed.url + "/metrics").text
    assert 'yieldgate_rejections_total{reason="rate_limit_exceeded"} 1.0' in metrics


def test_budget_shared_by_two_gateways_holds_under_concurrency(stack, redis_url, tmp_path,
                                                              gateway_process_factory):
    cfg_a = economics_config(stack, tmp_path / "a", redis_url, require_keys=True)
    cfg_b = economics_config(stack, tmp_path / "b", redis_url, require_keys=True)
    cfg_b.pricing.limits.prefix = cfg_a.pricing.limits.prefix  # same keys and budgets in Redis
    # Two gateway processes: the only thing they share is Redis.
    a, b = gateway_process_factory(cfg_a), gateway_process_factory(cfg_b)
    try:
        book = PriceBook(cfg_a.pricing)
        _, probe = create_key(a.url, team="probe")
        one = Decimal(chat(a.url, probe).headers["x-yieldgate-cost-usd"])
        budget = (one * 12).quantize(Decimal("1e-9"))
        key_id, secret = create_key(a.url, team="budget", budget_usd=str(budget), budget_period="total")
        with ThreadPoolExecutor(50) as pool:
            results = list(pool.map(lambda i: chat((a, b)[i % 2].url, secret), range(50)))
        codes = [r.status_code for r in results]
        assert set(codes) <= {200, 429} and codes.count(429) >= 1
        assert all(r.json()["error"]["code"] == "insufficient_quota" for r in results if r.status_code == 429)
        served = [r for r in results if r.status_code == 200]
        billed = sum(Decimal(r.headers["x-yieldgate-cost-usd"]) for r in served)
        # The reservation is the request's maximum cost, so the budget is never overshot by more
        # than one request's cost (here: not at all).
        max_one = book.max_cost("demo", "standard", 64, 4).total
        assert billed <= budget + max_one
        # Every request reserves its maximum cost: at least budget // max_one of them fit even if all
        # 50 reserve before any settles; more only as settles hand back the unused part of a reservation.
        assert budget // max_one <= len(served) <= budget // min(
            Decimal(r.headers["x-yieldgate-cost-usd"]) for r in served), (len(served), budget, max_one, one)
        # Both ledgers together hold exactly the served requests of this key.
        deadline = time.monotonic() + 20
        while True:
            spend = [httpx.get(g.url + "/admin/spend", params={"group_by": "key_id"}, headers=AUTH).json()
                     for g in (a, b)]
            rows = [r for s in spend for r in s["rows"] if r["group"]["key_id"] == key_id]
            if sum(r["requests"] for r in rows) == len(served) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert sum(r["requests"] for r in rows) == len(served)
        # One ledger row per gateway that served any (which one wins the budget's reservations is
        # a race: on a loaded machine one gateway can take them all).
        serving = {r.headers["x-yieldgate-gateway"] for r in served}
        assert all(r["requests"] > 0 for r in rows) and len(rows) == len(serving)
        # Redis agrees once every settle landed: nothing reserved, spent == billed (nano-USD ceil).
        deadline = time.monotonic() + 20
        while True:
            entry = next(e for e in httpx.get(a.url + "/admin/keys", headers=AUTH).json()["data"]
                         if e["key"]["id"] == key_id)
            if entry["budget"]["reserved_usd"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        spent = Decimal(repr(entry["budget"]["spent_usd"]))
        assert entry["budget"]["reserved_usd"] == 0
        assert billed <= spent <= billed + Decimal("1e-9") * len(served) and spent <= budget + max_one
    finally:
        clean_redis(redis_url, cfg_a.pricing.limits.prefix)


def test_open_mode_needs_no_redis(stack, tmp_path, gateway_factory):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    gw = gateway_factory(economics_config(stack, tmp_path, dead))
    resps = [httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=60,
                        headers={"authorization": "Bearer EMPTY"}) for _ in range(3)]
    assert [r.status_code for r in resps] == [200] * 3
    assert all("x-yieldgate-cost-usd" in r.headers for r in resps)
    # A yg- key cannot be checked without Redis: the gateway says so instead of serving unbudgeted.
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer yg-abc-def"},
                   timeout=30)
    assert r.status_code in (401, 503)


def test_tpm_limit_is_429_with_retry_after(keyed):
    tpm = 80
    _, secret = create_key(keyed.url, team="tpm", tpm=tpm)
    served: list[int] = []
    limited = None
    for _ in range(12):  # each request is ~25 tokens: the limit is reached within a few
        resp = chat(keyed.url, secret)
        if resp.status_code != 200:
            limited = resp
            break
        served.append(resp.json()["usage"]["total_tokens"])
    assert limited is not None, f"{len(served)} requests ({sum(served)} tokens) under tpm={tpm} all served"
    assert limited.status_code == 429
    err = limited.json()["error"]
    assert (err["type"], err["code"]) == ("rate_limit_error", "rate_limit_exceeded")
    assert "(tpm)" in err["message"]
    assert 1 <= int(limited.headers["retry-after"]) <= 120
    # Completion tokens count too (added after each answer): what was served fits the limit, give
    # or take the one request whose completion was counted after the next one was admitted.
    assert len(served) >= 1 and sum(served) <= tpm + max(served)
    # The other keys are not limited by this one's tokens.
    _, other = create_key(keyed.url, team="tpm-other", tpm=tpm)
    assert chat(keyed.url, other).status_code == 200


def test_closed_mode_without_redis_is_503_for_keyed_requests(stack, tmp_path, gateway_factory):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"redis://127.0.0.1:{s.getsockname()[1]}/0"
    config = economics_config(stack, tmp_path, dead)
    config.pricing.limits.on_redis_error = "closed"
    gw = gateway_factory(config)
    r = chat(gw.url, "yg-abc-def")
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and err["code"] == "key_store_unavailable"
    # Anonymous traffic needs no Redis in either mode.
    assert chat(gw.url, None).status_code == 200


def test_budget_period_rollover_lets_spending_start_again(keyed):
    budget = keyed.gateway.accounting.budget
    day = [time.time()]
    budget.clock = lambda: day[0]  # the enforcer keys budgets by the UTC day of this clock
    book = PriceBook(keyed.gateway.config.pricing)
    max_one = book.max_cost("demo", "standard", 64, 4).total
    key_id, secret = create_key(keyed.url, team="daily", budget_usd=str(max_one * 2), budget_period="daily")

    def spend_until_refused() -> int:
        for served in range(12):
            resp = chat(keyed.url, secret)
            if resp.status_code != 200:
                assert resp.status_code == 429 and resp.json()["error"]["code"] == "insufficient_quota"
                return served
        raise AssertionError("a budget of two requests' maximum cost served 12 requests")

    assert spend_until_refused() >= 2
    yesterday = day[0]
    day[0] += 86400  # the next UTC day: a new period with nothing spent
    assert spend_until_refused() >= 2
    day[0] = yesterday  # the old period is still spent
    refused = chat(keyed.url, secret)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "insufficient_quota"
    entry = next(e for e in httpx.get(keyed.url + "/admin/keys", headers=AUTH).json()["data"]
                 if e["key"]["id"] == key_id)
    assert entry["budget"]["period"] == time.strftime("d%Y-%m-%d", time.gmtime(yesterday))
