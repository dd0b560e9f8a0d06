"""The cache advisor, end to end: cache-hostile traffic through the real stack shows up in the API."""

from __future__ import annotations

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
