"""The dashboard in real headless Chromium: data from real requests, charts drawn, no console errors."""

from __future__ import annotations

import shutil
import time
import uuid

import httpx
import pytest

from needs import missing
from test_economics_billing import ADMIN, clean_redis, economics_config

CHROMIUM, CHROMEDRIVER = shutil.which("chromium") or "/usr/bin/chromium", "/usr/bin/chromedriver"
# Canvases whose plot area must hold drawn data (not just axes or a "no data" note).
DATA_CHARTS = ("chart-cost", "chart-cache", "chart-spend", "chart-tiers", "chart-routes", "chart-success",
               "chart-models", "chart-targets")
# Data is drawn in saturated colours; axes, grid and labels are greys.
COLOURFUL_PIXELS_JS = """
const c = document.getElementById(arguments[0]);
const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
let n = 0;
for (let i = 0; i < d.length; i += 4) {
  if (d[i + 3] > 0 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 80) n++;
}
return n;
"""


@pytest.fixture(scope="session", autouse=True)
def chromium_installed():
    """Session-scoped so it runs before the session stack starts: without a browser, nothing to wait for."""
    if not shutil.which("chromium") or not shutil.which("chromedriver"):
        missing("chromium / chromedriver not installed")


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                "--disable-dev-shm-usage", "--window-size=1400,1300"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(service=Service(shutil.which("chromedriver") or CHROMEDRIVER), options=opts)


def test_dashboard_renders_real_traffic(stack, redis_url, tmp_path, gateway_factory):
    config = economics_config(stack, tmp_path, redis_url, require_keys=True)
    gw = gateway_factory(config)
    try:
        auth = {"authorization": f"Bearer {ADMIN}"}
        secret = httpx.post(gw.url + "/admin/keys", json={"team": "dash", "name": "ui"}, headers=auth).json()["secret"]
        key = {"authorization": f"Bearer {secret}"}
        session = "dash-" + uuid.uuid4().hex[:6]
        system = "You are the dashboard assistant. " * 20
        for i, model in enumerate(["demo", "demo", "demo:fast", "demo"]):
            resp = httpx.post(gw.url + "/v1/chat/completions", timeout=60,
                              headers={**key, "x-session-id": session, "x-yieldgate-task": "dash-task"},
                              json={"model": model, "max_tokens": 4, "messages": [
                                  {"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}]})
            assert resp.status_code == 200
        # Agent clients' routes: the ledger keeps each request's route and the dashboard splits by it.
        # Two of each: the second reads the first's rendered system prompt from the prefix cache.
        for q in ("q4", "q4b"):
            resp = httpx.post(gw.url + "/v1/responses", headers={**key, "x-session-id": session}, timeout=60,
                              json={"model": "demo", "max_output_tokens": 4, "instructions": system, "input": q,
                                    "store": False})
            assert resp.status_code == 200, resp.text
        for q in ("q5", "q5b"):
            resp = httpx.post(gw.url + "/v1/messages", headers={**key, "x-session-id": session}, timeout=60,
                              json={"model": "demo", "max_tokens": 4, "system": system,
                                    "messages": [{"role": "user", "content": q}]})
            assert resp.status_code == 200, resp.text
        assert httpx.post(gw.url + "/v1/feedback", headers=key, json={"session_id": session, "passed": True}
                          ).status_code == 200
        # Credentials: none -> 401, a wrong ?token= -> 401; the page and data take the admin token.
        assert httpx.get(gw.url + "/dashboard").status_code == 401
        assert httpx.get(gw.url + "/dashboard/data", params={"token": "wrong"}).status_code == 401
        assert httpx.get(gw.url + "/dashboard/data", headers=key).status_code == 401
        data = httpx.get(gw.url + "/dashboard/data", headers=auth).json()
        assert data["tier_mix"]["standard"]["requests"] == 7 and data["tier_mix"]["fast"]["requests"] == 1
        routes = {r["route"]: r for r in data["routes"]}
        assert {k: r["requests"] for k, r in routes.items()} == {"chat": 4, "responses": 2, "messages": 2}
        # The second Responses and Messages requests read their system prompt from the prefix cache.
        assert routes["responses"]["cached_tokens"] > 0 and routes["messages"]["cached_tokens"] > 0
        assert any(s["team"] == "dash" and s["cost_usd"] > 0 for s in data["spend"])
        assert data["model_mix"]["demo"]["requests"] == 8 and data["model_mix"]["demo"]["cached_tokens"] > 0
        # What `auto` chooses on: the graded session's $ per solved task per (task class, target).
        targets = {(t["task"], t["target"]): t for t in data["targets"]}
        assert {("dash-task", "demo"), ("dash-task", "demo:fast"), ("", "demo")} == set(targets), targets
        assert all(t["successes"] == t["tasks_graded"] == 1 and t["usd_per_success"] > 0 for t in targets.values())
        # The fast tier's speed-up per workload class, next to what its requests paid over standard.
        speedup, = data["fast_speedup"]
        assert (speedup["class"], speedup["requests"], speedup["standard_requests"]) == ("chat, sampled", 1, 3)
        assert speedup["speedup"] > 0 and speedup["served_fast"] == 1 and speedup["price_multiple"] > 1.5
        time.sleep(1.2)  # a second sample point for the time series

        driver = browser()
        try:
            driver.get(f"{gw.url}/dashboard?token={ADMIN}")
            deadline = time.monotonic() + 30
            while driver.execute_script("return document.body.dataset.loaded") != "1":
                assert time.monotonic() < deadline, driver.find_element("id", "status").text
                time.sleep(0.2)
            driver.save_screenshot(str(tmp_path / "dashboard.png"))
            drawn = {c: driver.execute_script(COLOURFUL_PIXELS_JS, c) for c in DATA_CHARTS}
            assert all(n > 50 for n in drawn.values()), drawn
            kpis = driver.execute_script(
                "return Object.fromEntries([...document.querySelectorAll('#kpis .kpi')].map("
                "k => [k.querySelector('span').textContent, k.querySelector('b').textContent]))")
            assert kpis["requests (since start)"] == "8", kpis  # the eight requests above, no more
            assert kpis["tokens (since start)"] == str(sum(m["tokens"] for m in data["tier_mix"].values())), kpis
            row = driver.execute_script(
                "return [...document.querySelectorAll('#speedup tbody tr')].map(r => [...r.cells].map(c => c.textContent))")
            assert row == [["chat, sampled", f"{speedup['speedup']:.2f}×", f"{speedup['price_multiple']:.2f}×",
                            "100%", "1 / 3"]], row
            assert not driver.execute_script("return document.cookie")
            assert driver.execute_script("return localStorage.length") == 0
            errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors
        finally:
            driver.quit()
        assert (tmp_path / "dashboard.png").stat().st_size > 10_000
    finally:
        clean_redis(redis_url, config.pricing.limits.prefix)
