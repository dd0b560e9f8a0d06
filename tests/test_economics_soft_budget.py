"""A soft budget flags, never refuses: requests over it are served with `x-yieldgate-budget:
soft-exceeded` and counted in yieldgate_soft_budget_exceeded; a key within its budget is not flagged."""

from __future__ import annotations

import httpx

from test_economics_limits import chat, create_key, keyed  # noqa: F401  (keyed is a fixture)


def exceeded(url: str, key_id: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("yieldgate_soft_budget_exceeded_total{") and f'key="{key_id}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_over_a_soft_budget_requests_are_served_and_flagged(keyed):
    url = keyed.url
    over_id, over = create_key(url, team="soft", budget_usd="0", budget_kind="soft")
    within_id, within = create_key(url, team="soft", budget_usd="1000", budget_kind="soft")
    for _ in range(3):
        resp = chat(url, over)
        assert resp.status_code == 200, resp.text
        assert resp.headers.get("x-yieldgate-budget") == "soft-exceeded"
    ok = chat(url, within)
    assert ok.status_code == 200 and "x-yieldgate-budget" not in ok.headers
    assert exceeded(url, over_id) == 3
    assert exceeded(url, within_id) == 0
