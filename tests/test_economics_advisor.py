"""The cache advisor, end to end: cache-hostile traffic through the real stack shows up in the API."""

from __future__ import annotations

import json
import time
import uuid

import httpx

STABLE = "You are the support agent for a hardware store. Follow the return policy exactly. " * 12


def test_timestamp_in_system_prompt_is_reported_as_a_cache_breaker(client, stack):
    session = "adv-" + uuid.uuid4().hex[:8]
    for i in range(4):
        # The classic mistake: a clock at the top of the system prompt, before the stable text.
        system = f"Current time: 2026-11-30T12:{i:02d}:{(7 * i) % 60:02d}Z. " + STABLE
        client.chat.completions.create(
            model=stack.model, max_tokens=1, extra_headers={"x-session-id": session},
            messages=[{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}])
    headers = {"authorization": f"Bearer {stack.admin_token}"}
    deadline = time.monotonic() + 10
    while True:  # the advisor runs just after the response, on the event loop
        reports = httpx.get(stack.gateway_url + "/admin/cache-advisor", headers=headers, timeout=10).json()["data"]
        anon = next((r for r in reports if r["key_id"] == "anonymous"), None)
        if (anon and anon["breaks"] >= 3) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert anon is not None and anon["breaks"] >= 3
    assert anon["volatile_span_breaks"] >= 3
    assert anon["lost_tokens"] >= 3 * 100  # the stable text after the clock was recomputed each time
    assert anon["median_break_position"] < 32  # the break sits in the first block
    assert anon["advice"]


TOOLS = [
    {"name": name, "description": f"{what}. " + "Call it only when the customer asks about this. " * 3,
     "parameters": {"type": "object", "properties": {field: {"type": "string", "description": f"the {field}"}},
                    "required": [field]}}
    for name, what, field in (("lookup_order", "Find an order by its number", "order_number"),
                              ("start_return", "Open a return for a delivered order", "order_number"),
                              ("check_stock", "Count the units of a product in a store", "product_sku"),
                              ("store_hours", "Opening hours of one store on one day", "store_id"))]


def test_reordered_tools_are_reported_as_a_cache_breaker(stack, gateway_factory, redis_url):
    """An agent framework that serializes its tools into the system prompt in a different order on
    every turn (the demo chat template renders no `tools` field, so they travel in the prompt)."""
    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig

    admin = "adv-admin-" + uuid.uuid4().hex[:8]
    # A gateway of its own: its advisor has seen no other test's traffic.
    gw = gateway_factory(Config(
        server=ServerConfig(admin_token=admin, redis_url=redis_url),
        fleet=FleetConfig(model="demo", model_path=str(stack.model_dir), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="standard-0", tier="standard", url=stack.engines["standard"])])))
    session = "adv-tools-" + uuid.uuid4().hex[:8]
    orders = [[0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0], [1, 3, 0, 2]]
    for i, order in enumerate(orders):
        system = "You are the store's agent. Tools:\n" + "\n".join(json.dumps(TOOLS[t]) for t in order)
        resp = httpx.post(gw.url + "/v1/chat/completions", timeout=60, headers={"x-session-id": session}, json={
            "model": "demo", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}"}]})
        assert resp.status_code == 200, resp.text
    auth = {"authorization": f"Bearer {admin}"}
    deadline = time.monotonic() + 10
    while True:  # the advisor runs just after the response, on the event loop
        report = httpx.get(gw.url + "/admin/cache-advisor", params={"key_id": "anonymous"}, headers=auth,
                           timeout=10).json()["data"][0]
        if report["requests"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["requests"] == 3  # each prompt after the first, against its predecessor
    assert report["breaks"] == report["reordered_breaks"] == 3
    assert report["volatile_span_breaks"] == 0
    assert report["lost_tokens"] >= 3 * 100  # the tools after the first moved one were recomputed
    assert "reordered" in report["advice"] and "stable order" in report["advice"]
    # The dashboard lists the same key as a cache breaker.
    data = httpx.get(gw.url + "/dashboard/data", headers=auth, timeout=10).json()
    breaker = next(b for b in data["cache_breakers"] if b["key_id"] == "anonymous")
    assert breaker["breaks"] == 3 and breaker["advice"] == report["advice"]


def test_agent_routes_are_in_the_ledger_with_their_route_and_feed_the_advisor(stack, gateway_factory, redis_url):
    """Responses and Messages requests: one ledger row each, labelled with its route, and a clock in
    a Messages conversation's system prompt is reported like a chat client's."""
    import csv
    import io

    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig

    admin = "adv-admin-" + uuid.uuid4().hex[:8]
    gw = gateway_factory(Config(
        server=ServerConfig(admin_token=admin, redis_url=redis_url),
        fleet=FleetConfig(model="demo", model_path=str(stack.model_dir), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="standard-0", tier="standard", url=stack.engines["standard"])])))
    session = "adv-msg-" + uuid.uuid4().hex[:8]
    ids = {}
    for i in range(4):
        system = f"Current time: 2026-11-30T12:{i:02d}:{(7 * i) % 60:02d}Z. " + STABLE
        rid = f"req-adv-msg-{i}-{uuid.uuid4().hex[:8]}"
        resp = httpx.post(gw.url + "/v1/messages", timeout=60, headers={"x-request-id": rid}, json={
            "model": "demo", "max_tokens": 1, "system": system, "metadata": {"user_id": session},
            "messages": [{"role": "user", "content": f"question {i}"}]})
        assert resp.status_code == 200, resp.text
        ids[rid] = "messages"
    rid = "req-adv-resp-" + uuid.uuid4().hex[:8]
    resp = httpx.post(gw.url + "/v1/responses", timeout=60, headers={"x-request-id": rid}, json={
        "model": "demo", "max_output_tokens": 1, "instructions": STABLE, "input": "hello", "store": False})
    assert resp.status_code == 200, resp.text
    ids[rid] = "responses"
    auth = {"authorization": f"Bearer {admin}"}
    deadline = time.monotonic() + 10
    while True:  # the advisor runs just after the response, on the event loop
        report = httpx.get(gw.url + "/admin/cache-advisor", params={"key_id": "anonymous"}, headers=auth,
                           timeout=10).json()["data"][0]
        if report["breaks"] >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert report["breaks"] == report["volatile_span_breaks"] == 3
    assert report["lost_tokens"] >= 3 * 100
    rows = list(csv.DictReader(io.StringIO(httpx.get(gw.url + "/admin/ledger.csv", headers=auth, timeout=30).text)))
    assert {r["request_id"]: r["route"] for r in rows if r["request_id"] in ids} == ids
    spend = httpx.get(gw.url + "/admin/spend", params={"group_by": "route"}, headers=auth, timeout=30).json()
    by_route = {row["group"]["route"]: row["requests"] for row in spend["rows"]}
    assert by_route.get("messages", 0) >= 4 and by_route.get("responses", 0) >= 1, by_route
