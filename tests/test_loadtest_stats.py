"""Pure parts of the load tester: statistics, SSE parsing, prices, metrics parsing, workload determinism."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from yieldgate.loadtest import (
    AgentSessionWorkload,
    Bounds,
    CodeEditWorkload,
    PriceTable,
    RandomLengthWorkload,
    RequestRecord,
    SharedPrefixWorkload,
    SSEDecoder,
    SweepLoad,
    TraceWorkload,
    WorkloadError,
    distribution,
    goodput,
    meets_slo,
    percentile,
    summarize,
    throughput_windows,
)
from yieldgate.loadtest.engine_metrics import delta, metrics_url, parse_counters
from yieldgate.loadtest.price import Price


# -- statistics ---------------------------------------------------------------------------------


@pytest.mark.parametrize("q", [0, 1, 25, 50, 90, 99, 99.9, 100])
def test_percentile_matches_numpy_linear(q):
    values = [float(x) for x in np.random.default_rng(3).lognormal(3, 1, 257)]
    assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edge_cases():
    assert math.isnan(percentile([], 50))
    assert percentile([7.0], 99) == 7.0
    assert percentile([1.0, 2.0], 50) == 1.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_distribution_ignores_missing_and_reports_moments():
    d = distribution([1.0, 2.0, 3.0, 4.0, float("nan")])
    assert d.count == 4
    assert d.mean == 2.5 and d.min == 1.0 and d.max == 4.0
    assert d.p(50) == 2.5
    assert d.stdev == pytest.approx(float(np.std([1, 2, 3, 4])))
    empty = distribution([])
    assert empty.count == 0 and math.isnan(empty.p(99))


def test_goodput_counts_requests_meeting_every_slo():
    reqs = [
        {"ttft_ms": 100.0, "tpot_ms": 10.0},
        {"ttft_ms": 600.0, "tpot_ms": 10.0},  # TTFT too slow
        {"ttft_ms": 100.0, "tpot_ms": 60.0},  # TPOT too slow
        {"ttft_ms": 200.0, "tpot_ms": None},  # one-token answer: TPOT not applicable
    ]
    slo = {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert [meets_slo(r, slo) for r in reqs] == [True, False, False, True]
    assert goodput(reqs, slo, duration_s=2.0) == 1.0
    assert goodput(reqs, slo, duration_s=0.0) == 0.0


def test_throughput_windows_buckets_and_fills_gaps():
    events = [(0.1, 10.0), (0.4, 10.0), (2.2, 5.0)]
    w = throughput_windows(events, 1.0, start=0.0, end=3.0)
    assert w == [(0.0, 20.0), (1.0, 0.0), (2.0, 5.0)]
    assert throughput_windows([], 1.0) == []
    with pytest.raises(ValueError):
        throughput_windows(events, 0)


def _rec(i, ttft, e2e, out=10, ok=True, warm=False, cached=None, prompt=100, cost=None):
    return RequestRecord(id=i, target="t", session=f"s{i}", ok=ok, warmup=warm, start_s=i * 0.5,
                         end_s=i * 0.5 + e2e / 1000, ttft_ms=ttft if ok else None, e2e_ms=e2e if ok else None,
                         tpot_ms=(e2e - ttft) / (out - 1) if ok else None, completion_tokens=out if ok else 0,
                         prompt_tokens=prompt if ok else 0, cached_tokens=cached, cost=cost,
                         cost_source="price_table" if cost is not None else None,
                         error=None if ok else "http_500")


def test_summarize_excludes_warmup_and_computes_economics():
    recs = [_rec(0, 900, 1000, warm=True, cached=0, cost=1.0)] + [
        _rec(i, 100 * i, 100 * i + 90, cached=50, cost=0.001) for i in range(1, 5)
    ] + [_rec(5, 0, 0, ok=False)]
    s = summarize("t", recs, duration_s=2.0, slo={"ttft_ms": 250}, client_cpu_s=0.005)
    assert (s.requests, s.completed, s.failed, s.warmup) == (5, 4, 1, 1)
    assert s.request_throughput == 2.0
    assert s.output_token_throughput == 20.0
    assert s.errors == {"http_500": 1}
    assert s.goodput == 1.0  # ttft 100 and 200 meet 250 ms
    assert s.goodput_fraction == pytest.approx(2 / 5)
    assert s.cached_ratio == 0.5
    assert s.cost_total == pytest.approx(0.004)
    assert s.cost_per_1m_tokens == pytest.approx(0.004 / 440 * 1e6)
    assert s.ttft_ms.p(50) == 250.0
    assert s.client_cpu_us_per_request == pytest.approx(1000.0)
    assert s.per_replica is None  # no x-yieldgate-replica header: not a gateway target


def test_summarize_splits_by_serving_replica():
    recs = [_rec(i, 100 * i, 100 * i + 90, cached=50) for i in range(1, 7)]
    for r in recs:
        r.replica = "a" if r.id % 3 else "b"
    recs[0].cached_tokens = 0  # id 1 -> replica a
    s = summarize("t", recs)
    assert {k: v.requests for k, v in s.per_replica.items()} == {"a": 4, "b": 2}
    assert s.per_replica["b"].cached_ratio == 0.5
    assert s.per_replica["a"].cached_ratio == pytest.approx(150 / 400)
    assert s.per_replica["b"].ttft_ms.count == 2


# -- SSE ----------------------------------------------------------------------------------------


def test_sse_decoder_handles_split_crlf_comments_multiline_and_errors():
    raw = (b": keep-alive\r\n\r\ndata: {\"a\":1}\r\n\r\ndata: line1\ndata: line2\n\n"
           b"event: error\ndata: {\"error\":{\"message\":\"boom\"}}\n\ndata: [DONE]")
    dec = SSEDecoder()
    events = []
    for i in range(0, len(raw), 7):  # arbitrary TCP splits
        events += dec.feed(raw[i:i + 7])
    events += dec.flush()
    assert [(e.event, e.data) for e in events] == [
        ("message", b'{"a":1}'),
        ("message", b"line1\nline2"),
        ("error", b'{"error":{"message":"boom"}}'),
        ("message", b"[DONE]"),
    ]


# -- prices and engine metrics ---------------------------------------------------------------------


def test_price_table_cli_and_cost():
    table = PriceTable.parse_cli(["input=0.5,cached_input=0.05,output=1.5", "demo:fast:input=1,output=4"])
    std = table.for_target("x", "demo")
    fast = table.for_target("x", "demo:fast")
    assert std == Price(input=0.5, cached_input=0.05, output=1.5)
    assert fast == Price(input=1.0, output=4.0)
    assert std.cost(1000, 400, 100) == pytest.approx((600 * 0.5 + 400 * 0.05 + 100 * 1.5) / 1e6)
    assert fast.cost(1000, 400, 0) == pytest.approx(1000 / 1e6)  # no cached price: no discount


def test_price_table_file(tmp_path):
    p = tmp_path / "prices.toml"
    p.write_text('[prices."*"]\ninput = 0.2\noutput = 0.8\n')
    assert PriceTable.load(p).for_target("a", "b") == Price(input=0.2, output=0.8)


PROM = """# HELP vllm:prefix_cache_queries Prefix cache queries
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="demo"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="demo"} 50.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="demo"} 60.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="demo"} 40.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="demo"} 10.0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="demo"} 10.0
"""


def test_parse_counters_sums_labels_and_delta_ratios():
    c = parse_counters(PROM)
    assert c["vllm:prefix_cache_queries_total"] == 150.0
    d = delta(["u"], {"vllm:prefix_cache_queries_total": 50.0}, c)
    assert d.prefix_hit_ratio == pytest.approx(60 / 100)
    assert d.spec_acceptance_rate == pytest.approx(0.25)
    assert d.spec_mean_accepted_length == pytest.approx(2.0)
    assert metrics_url("http://h:1/v1") == "http://h:1/metrics"


# -- workloads ----------------------------------------------------------------------------------


def _trace(tmp_path):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join([
        '{"timestamp": 0.0, "prompt": "hello there", "output_tokens": 4}',
        '{"timestamp_ms": 250, "input_length": 40, "output_length": 3, "hash_ids": [1, 2]}',
        '{"timestamp": 0.1, "input_tokens": 40, "output_tokens": 3, "hash_ids": [1, 3]}',
        '{"timestamp": 0.3, "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}',
    ]) + "\n")
    return str(p)


def _workloads(tmp_path, seed):
    return [
        SharedPrefixWorkload(seed=seed, tenants=3, prefix_tokens=40, users_per_tenant=2, suffix_tokens=8),
        AgentSessionWorkload(seed=seed, think_time_s=0.5),
        RandomLengthWorkload(seed=seed, input_tokens=50, output_tokens=20, range_ratio=0.5),
        CodeEditWorkload(seed=seed),
        TraceWorkload(seed=seed, path=_trace(tmp_path), hash_block_tokens=16),
    ]


def test_same_seed_same_requests_different_seed_differs(tmp_path):
    for a, b, c in zip(_workloads(tmp_path, 7), _workloads(tmp_path, 7), _workloads(tmp_path, 8)):
        sa, sb, sc = a.take(4), b.take(4), c.take(4)
        assert msgspec.json.encode(sa) == msgspec.json.encode(sb), type(a).__name__
        if not isinstance(a, TraceWorkload):  # a trace file with prompts does not depend on the seed
            assert msgspec.json.encode(sa) != msgspec.json.encode(sc), type(a).__name__


def test_shared_prefix_tenants_share_system_prompt():
    sessions = SharedPrefixWorkload(tenants=2, users_per_tenant=2, prefix_tokens=30).take(40)
    by_tenant = {}
    for s in sessions:
        by_tenant.setdefault(s.group, set()).add(s.system)
    assert len(by_tenant) == 2 and all(len(v) == 1 for v in by_tenant.values())
    assert len(sessions[0].system.split()) >= 30 * 0.75


def test_agent_sessions_have_tool_outputs_and_think_time():
    s = AgentSessionWorkload(turns_min=3, turns_max=3, think_time_s=1.0).take(2)
    assert all(len(x.turns) == 3 for x in s)
    assert s[0].turns[0].tool_output is None
    assert all(t.tool_output and t.tool_output.startswith("<tool_result") for t in s[0].turns[1:])
    assert all(t.think_time_s > 0 for t in s[0].turns[1:])


def test_random_lengths_stay_in_range():
    for s in RandomLengthWorkload(input_tokens=100, output_tokens=40, range_ratio=0.25).take(50):
        t = s.turns[0]
        assert 75 <= t.input_tokens_est <= 125 and 30 <= t.max_tokens <= 50


def test_code_edit_prompt_contains_the_code_and_names_the_change():
    t = CodeEditWorkload(functions=3).take(1)[0].turns[0]
    assert "```python\ndef " in t.user and "Rename the function" in t.user
    assert t.max_tokens >= t.input_tokens_est * 0.9


def test_trace_replay_orders_by_timestamp_and_rebuilds_shared_blocks(tmp_path):
    sessions = TraceWorkload(path=_trace(tmp_path), hash_block_tokens=16).take(10)
    assert [s.arrival_s for s in sessions] == pytest.approx([0.0, 0.1, 0.25, 0.3])
    b1 = sessions[1].turns[0].user  # hash_ids [1, 3]
    b2 = sessions[2].turns[0].user  # hash_ids [1, 2]
    block = " ".join(b1.split()[:12])
    assert b2.startswith(block)  # same hash id, same text block
    assert sessions[3].system == "sys"
    looped = TraceWorkload(path=_trace(tmp_path), loop=True).take(6)
    assert looped[4].arrival_s > looped[3].arrival_s


def test_trace_errors(tmp_path):
    with pytest.raises(WorkloadError):
        TraceWorkload(path=str(tmp_path / "missing.jsonl")).take(1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(WorkloadError):
        TraceWorkload(path=str(bad)).take(1)


def test_sweep_schedule_and_bounds_validation():
    assert SweepLoad(start_rate=1, factor=2, max_rate=8).schedule() == [1, 2, 4, 8]
    assert SweepLoad(rates=[3, 5]).schedule() == [3, 5]
    with pytest.raises(ValueError):
        Bounds(requests=None, duration_s=None)


def test_config_file_parses_tagged_workload_and_load(tmp_path):
    from yieldgate.loadtest import LoadTestConfig, PoissonLoad, SharedPrefixWorkload

    p = tmp_path / "lt.toml"
    p.write_text("""
[loadtest]
order = "interleaved"
[[loadtest.targets]]
base_url = "http://127.0.0.1:1"
model = "demo"
[[loadtest.targets]]
base_url = "http://127.0.0.1:1"
model = "demo:fast"
extra_body = { service_tier = "priority" }
[loadtest.workload]
kind = "shared_prefix"
prefix_tokens = 32
[loadtest.load]
kind = "poisson"
rate = 3.5
burstiness = 0.5
[loadtest.slo]
ttft_ms = 500
[loadtest.prices."*"]
input = 0.5
output = 1.5
""")
    cfg = LoadTestConfig.load_file(p)
    assert isinstance(cfg.workload, SharedPrefixWorkload) and cfg.workload.prefix_tokens == 32
    assert cfg.load == PoissonLoad(rate=3.5, burstiness=0.5)
    assert cfg.targets[1].extra_body == {"service_tier": "priority"}
    assert cfg.slo == {"ttft_ms": 500.0} and cfg.prices["*"].output == 1.5
    assert cfg.workload.describe()["kind"] == "shared_prefix"


def _parse_stream(raw: bytes):
    from yieldgate.loadtest import RequestOutcome, Target
    from yieldgate.loadtest.client import OpenAIClient

    client = OpenAIClient(Target(base_url="http://x"))
    out = RequestOutcome(start=0.0)
    parts, done = [], False
    dec = SSEDecoder()
    for i, ev in enumerate(dec.feed(raw) + dec.flush()):
        done = client._event(ev.event, ev.data, float(i + 1), parts, out.token_times, out) or done
    return out, "".join(parts), done


def test_stream_parsing_usage_cost_and_error_events():
    raw = (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
           b'data: {"choices":[{"delta":{"content":"Hel"}}]}\n\n'
           b'data: {"choices":[{"delta":{"content":"lo"}}]}\n\n'
           b'data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2,'
           b'"prompt_tokens_details":{"cached_tokens":4},"cost":{"currency":"USD","total":"0.0000125"}}}\n\n'
           b'data: [DONE]\n\n')
    out, text, done = _parse_stream(raw)
    assert done and text == "Hello" and out.error is None
    assert out.first_token == 1.0 and out.token_times == [1.0, 2.0, 3.0]
    assert out.usage.cached_tokens == 4
    assert out.cost == pytest.approx(0.0000125)

    out, _, done = _parse_stream(b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n'
                                 b'data: {"error":{"message":"engine died","type":"server_error"}}\n\n')
    assert not done and out.error == "stream_error" and out.error_detail == "engine died"
    out, _, _ = _parse_stream(b'event: error\ndata: overloaded\n\n')
    assert out.error == "stream_error"


def test_non_stream_body_cost_as_number():
    from yieldgate.loadtest import RequestOutcome, Target
    from yieldgate.loadtest.client import OpenAIClient

    out = RequestOutcome(start=0.0)
    OpenAIClient(Target(base_url="http://x", stream=False))._read_body(
        b'{"choices":[{"message":{"content":"hi"}}],"usage":{"prompt_tokens":3,"completion_tokens":1,'
        b'"cost":0.5}}', out)
    assert out.text == "hi" and out.cost == 0.5 and out.error is None


def test_tpot_runs_from_first_to_last_token_not_to_the_end_of_the_stream():
    # vllm bench serve's definition: the usage chunk and [DONE] after the last token are E2E only.
    from yieldgate.loadtest import RandomLengthWorkload, Target
    from yieldgate.loadtest.client import RequestOutcome
    from yieldgate.loadtest.wire import WireUsage
    from yieldgate.loadtest.runner import Runner, _Phase
    from yieldgate.loadtest.workload import Session

    runner = Runner(Target(base_url="http://127.0.0.1:9", model="m", stream=True),
                    RandomLengthWorkload(input_tokens=8, output_tokens=5))
    out = RequestOutcome(start=10.0, end=11.0, first_token=10.1, token_times=[10.1, 10.2, 10.3, 10.4, 10.5],
                  status=200, usage=WireUsage(prompt_tokens=8, completion_tokens=5))
    rec = runner._record(_Phase(None, None, 0, 10.0), Session(id="s", turns=[]), 0, (0, False), 10.0, 8, out)
    assert rec.ttft_ms == pytest.approx(100.0)
    assert rec.e2e_ms == pytest.approx(1000.0)
    assert rec.tpot_ms == pytest.approx(100.0)  # (10.5 - 10.1) / 4, not (1.0 - 0.1) / 4
