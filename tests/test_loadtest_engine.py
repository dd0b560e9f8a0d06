"""Every workload and every load mode, briefly, against a real engine (the gateway when `stack` exists)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from yieldgate.loadtest import (
    AgentSessionWorkload,
    Bounds,
    CacheSalt,
    CodeEditWorkload,
    ConcurrencyLoad,
    PoissonLoad,
    PriceTable,
    RandomLengthWorkload,
    ReplayLoad,
    SharedPrefixWorkload,
    SweepLoad,
    Target,
    TraceWorkload,
    run_compare,
    run_load,
)

pytestmark = pytest.mark.engine

TINY = dict(words_per_token=0.5)


def _stack(request):
    try:
        return request.getfixturevalue("stack")
    except pytest.FixtureLookupError:
        return None


@pytest.fixture(scope="module")
def target_url(request) -> str:
    stack = _stack(request)
    if stack is not None:
        return stack.gateway_url
    url = os.environ.get("YIELDGATE_TEST_TARGET_URL")
    if not url:
        pytest.skip("no `stack` fixture and YIELDGATE_TEST_TARGET_URL unset")
    return url


@pytest.fixture(scope="module")
def engine_url(request, target_url) -> str:
    """A bare vLLM engine (for /metrics and vLLM-only fields); the target itself outside a stack."""
    stack = _stack(request)
    if stack is not None:
        return stack.engines["standard"]
    return os.environ.get("YIELDGATE_TEST_ENGINE_URL", target_url)


@pytest.fixture(scope="module")
def model(request) -> str:
    stack = _stack(request)
    return stack.model if stack is not None else os.environ.get("YIELDGATE_TEST_MODEL", "demo")


@pytest.fixture(scope="module")
def target(target_url, model, request) -> Target:
    stack = _stack(request)
    key = stack.extra.get("api_key") if stack is not None else os.environ.get("YIELDGATE_TEST_API_KEY")
    return Target(base_url=target_url, model=model, api_key=key)


def _ok(result, n):
    s = result.summary
    assert s.failed == 0, s.errors
    assert s.completed == n
    assert s.ttft_ms.count == n and s.e2e_ms.p(50) > 0
    assert s.output_token_throughput > 0
    return s


def test_shared_prefix_closed_loop_with_slo_prices_engine_metrics(target, engine_url):
    wl = SharedPrefixWorkload(tenants=2, users_per_tenant=2, prefix_tokens=64, suffix_tokens=8, output_tokens=8,
                              **TINY)
    prices = PriceTable.parse_cli(["input=0.5,cached_input=0.05,output=1.5"])
    r = run_load(target, wl, ConcurrencyLoad(concurrency=2), Bounds(requests=6, warmup_requests=2),
                 slo={"ttft_ms": 60_000, "tpot_ms": 60_000}, prices=prices, engine_metrics_urls=[engine_url],
                 cache_salt=CacheSalt.random())
    s = _ok(r, 6)
    assert s.warmup == 2 and len(r.records) == 8
    warm = [rec for rec in r.records if rec.warmup]
    assert max(w.end_s for w in warm) <= min(rec.start_s for rec in r.records if not rec.warmup)
    assert s.goodput == s.request_throughput  # generous SLOs: all good
    assert s.cached_ratio is not None and s.cached_ratio > 0  # tenants' prefixes were reused
    assert s.cost_total and s.cost_total > 0 and s.cost_per_1m_tokens > 0
    assert s.engine is not None and s.engine["counters"]["vllm:prefix_cache_queries_total"] > 0
    assert s.client_cpu_us_per_request and s.client_cpu_us_per_request > 0
    assert {rec.group for rec in r.records} <= {"tenant-0", "tenant-1"}


def test_agent_sessions_carry_history_poisson(target):
    wl = AgentSessionWorkload(system_tokens=32, first_user_tokens=16, tool_output_tokens=16, followup_tokens=8,
                              turns_min=3, turns_max=3, output_tokens=8, think_time_s=0.02, **TINY)
    r = run_load(target, wl, PoissonLoad(rate=2, burstiness=0.5), Bounds(requests=6),
                 cache_salt=CacheSalt.random())
    _ok(r, 6)
    by_session = {}
    for rec in r.records:
        by_session.setdefault(rec.session, []).append(rec)
    # The checks below look at follow-up turns: some session must have reached one within the bound.
    # At 2 sessions/s new sessions take the 6 slots over seconds, so a first turn that is slow to
    # prefill on a loaded machine still leaves a slot for its follow-up.
    assert any(len(turns) >= 2 for turns in by_session.values()), {k: len(v) for k, v in by_session.items()}
    for turns in by_session.values():
        turns.sort(key=lambda x: x.turn)
        prompts = [t.prompt_tokens for t in turns]
        assert prompts == sorted(prompts) and len(set(prompts)) == len(prompts)  # append-only context grows
        for t in turns[1:]:
            assert t.cached_tokens and t.cached_tokens > 0  # earlier turns are a cached prefix


def test_random_lengths_completions_api_non_streaming(target):
    t = Target(base_url=target.base_url, model=target.model, api="completions", stream=False,
               api_key=target.api_key)
    wl = RandomLengthWorkload(input_tokens=32, output_tokens=8, range_ratio=0.5, **TINY)
    r = run_load(t, wl, ConcurrencyLoad(concurrency=3), Bounds(requests=5))
    s = _ok(r, 5)
    assert s.tpot_ms.count == 0  # no stream, no per-token timing
    assert all(rec.prompt_tokens > 0 for rec in r.records)


def test_code_edit_workload_streams_tokens(target):
    wl = CodeEditWorkload(functions=2, lines_per_function=3, **TINY)
    r = run_load(msgcopy(target, ignore_eos=True), wl, ConcurrencyLoad(concurrency=2), Bounds(requests=2))
    s = _ok(r, 2)
    assert s.itl_ms.count > 0 and s.tpot_ms.count == 2
    assert all(rec.completion_tokens > 8 for rec in r.records)


def msgcopy(target, **changes):
    import msgspec

    return msgspec.structs.replace(target, **changes)


def test_trace_replay_follows_timestamps(target, tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps({"timestamp": i * 0.1, "input_tokens": 24, "output_tokens": 4}) + "\n"
                         for i in range(4)))
    r = run_load(target, TraceWorkload(path=str(p), **TINY), ReplayLoad(speedup=2.0), Bounds(requests=10))
    _ok(r, 4)
    sched = sorted(rec.scheduled_s for rec in r.records)
    assert [round(b - a, 3) for a, b in zip(sched, sched[1:])] == [0.05, 0.05, 0.05]


def test_duration_bound_stops_the_run(target):
    wl = RandomLengthWorkload(input_tokens=16, output_tokens=4, **TINY)
    r = run_load(target, wl, ConcurrencyLoad(concurrency=2), Bounds(requests=None, duration_s=0.5))
    assert r.summary.completed >= 1 and r.summary.failed == 0
    assert max(rec.start_s for rec in r.records) < 1.0


def test_rate_sweep_reports_each_step(target):
    wl = RandomLengthWorkload(input_tokens=16, output_tokens=4, **TINY)
    r = run_load(target, wl, SweepLoad(rates=[4, 8], max_error_rate=0.5, min_achieved_ratio=0.0,
                                       max_ttft_growth=1e9), Bounds(requests=4))
    assert [st.summary.offered_rate for st in r.steps] == [4, 8]
    assert all(st.summary.completed == 4 for st in r.steps)
    assert len(r.records) == 8 and r.stop_reason is None


def test_sweep_stops_on_saturation(target):
    wl = RandomLengthWorkload(input_tokens=16, output_tokens=4, **TINY)
    # An impossible achieved-rate floor ends the sweep after its first step.
    r = run_load(target, wl, SweepLoad(rates=[1000, 2000], min_achieved_ratio=10.0), Bounds(requests=3))
    assert len(r.steps) == 1 and "achieved" in r.stop_reason


def test_cache_salt_prefix_and_field_isolate_runs(target, engine_url):
    wl = SharedPrefixWorkload(tenants=1, users_per_tenant=1, prefix_tokens=96, suffix_tokens=4, output_tokens=4,
                              **TINY)
    one = Bounds(requests=1)
    salt = CacheSalt.random()
    run_load(target, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=salt)
    again = run_load(target, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=salt)
    fresh = run_load(target, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=CacheSalt.random())
    assert again.records[0].cached_tokens > 0
    assert fresh.records[0].cached_tokens == 0
    # vLLM's own cache_salt field: same prompt, different salt, no shared blocks.
    eng = Target(base_url=engine_url, model=target.model)
    field = CacheSalt.random(mode="field")
    run_load(eng, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=field)
    other = run_load(eng, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=CacheSalt.random(mode="field"))
    same = run_load(eng, wl, ConcurrencyLoad(concurrency=1), one, cache_salt=field)
    assert other.records[0].cached_tokens == 0 and same.records[0].cached_tokens > 0


def test_compare_interleaved_same_workload(target):
    a = msgcopy(target, name="plain")
    b = msgcopy(target, name="salted", extra_body={"user": "loadtest"})
    wl = RandomLengthWorkload(input_tokens=16, output_tokens=4, **TINY)
    ra, rb = run_compare([a, b], wl, ConcurrencyLoad(concurrency=2), Bounds(requests=4), order="interleaved",
                         rounds=2, cache_salt="auto")
    assert ra.summary.completed == rb.summary.completed == 4
    # Same seeded workload: both targets saw the same sessions in the same order.
    assert [x.session for x in ra.records] and sorted(x.session for x in ra.records) == sorted(
        x.session for x in rb.records)


def test_errors_are_counted_by_type(target):
    bad = msgcopy(target, model="no-such-model")
    r = run_load(bad, RandomLengthWorkload(input_tokens=8, output_tokens=2), ConcurrencyLoad(concurrency=1),
                 Bounds(requests=2))
    assert r.summary.completed == 0 and r.summary.failed == 2
    (kind,) = r.summary.errors
    assert kind.startswith("http_4")
    assert r.records[0].error_detail


def test_cli_writes_every_output(target, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "yieldgate.loadtest", "-t", target.base_url, "-m", target.model, "-w", "random",
           "--input-tokens", "16", "--output-tokens", "4", "-n", "4", "-c", "2", "--slo", "ttft_ms=60000",
           "--price", "input=1,output=2", "--no-progress", "-o", str(out)]
    if target.api_key:
        cmd += ["--api-key", target.api_key]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    assert "goodput" in proc.stdout
    doc = json.loads((out / "summary.json").read_text())
    assert doc["results"][0]["summary"]["completed"] == 4
    assert len((out / "requests.jsonl").read_text().splitlines()) == 4
    assert (out / "summary.csv").read_text().startswith("step,target")
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 3


def test_config_file_run_through_cli(target, tmp_path):
    cfg = tmp_path / "lt.toml"
    key = f'\napi_key = "{target.api_key}"' if target.api_key else ""
    cfg.write_text(f"""
[loadtest]
order = "interleaved"
rounds = 2
cache_salt = "auto"
[[loadtest.targets]]
name = "a"
base_url = "{target.base_url}"
model = "{target.model}"{key}
[[loadtest.targets]]
name = "b"
base_url = "{target.base_url}"
model = "{target.model}"
stream = false{key}
[loadtest.workload]
kind = "random"
input_tokens = 12
output_tokens = 4
[loadtest.load]
kind = "poisson"
rate = 20
[loadtest.bounds]
requests = 4
""")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "yieldgate.loadtest", "--config", str(cfg), "--no-progress", "--no-html",
                           "-o", str(out)], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent.parent)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    doc = json.loads((out / "summary.json").read_text())
    assert [r["target"] for r in doc["results"]] == ["a", "b"]
    assert all(r["summary"]["completed"] == 4 for r in doc["results"])
    assert doc["ratios_vs_first"]["b"]["request throughput"] > 0
