"""Reading an engine's /metrics: only the families the gateway uses are parsed, so a text that
grows with every adapter set the engine ran stays cheap to read, and reads the same."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from yieldgate.serving.fleet import SCRAPED, parse_engine_metrics
from yieldgate.serving.lora import busy_adapters


def engine_text(running: float, lora_sets: int) -> str:
    lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches.",
             "# TYPE vllm:num_requests_running gauge",
             f'vllm:num_requests_running{{engine="0",model_name="demo"}} {running}',
             "# HELP vllm:num_requests_running_extra A longer name that shares the prefix.",
             "# TYPE vllm:num_requests_running_extra gauge",
             'vllm:num_requests_running_extra{engine="0"} 99.0',
             "# TYPE vllm:prefix_cache_queries counter",
             'vllm:prefix_cache_queries_total{engine="0",model_name="demo"} 120.0',
             'vllm:prefix_cache_queries_created{engine="0",model_name="demo"} 1.7e9',
             "# TYPE vllm:cache_config_info gauge",
             'vllm:cache_config_info{block_size="32",num_gpu_blocks="192"} 1.0',
             "# TYPE process_start_time_seconds gauge", "process_start_time_seconds 1.75e9",
             "# TYPE vllm:lora_requests_info gauge"]
    # One series per adapter set ever seen, newest value last seen; written out of order.
    stamps = [1.7e9 + (i * 7919) % lora_sets for i in range(lora_sets)]
    lines += [f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters="a{int(t) % 100000},b",'
              f'waiting_lora_adapters=""}} {t}' for t in stamps]
    return "\n".join(lines) + "\n"


def full_parse(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = s.name.removesuffix("_total")
            if name in SCRAPED:
                values[name] = values.get(name, 0.0) + s.value
    return values


def test_the_scrape_reads_what_a_full_parse_reads():
    text = engine_text(running=3, lora_sets=5000)
    values, capacity = parse_engine_metrics(text)
    assert values == full_parse(text) == {"vllm:num_requests_running": 3.0, "vllm:prefix_cache_queries": 120.0,
                                          "process_start_time_seconds": 1.75e9}
    assert capacity == 192


def test_busy_adapters_are_the_newest_set_and_none_while_idle():
    text = engine_text(running=1, lora_sets=5000)
    newest = int(1.7e9 + 4999) % 100000
    assert busy_adapters(text) == {f"a{newest}", "b"}
    assert busy_adapters(engine_text(running=0, lora_sets=50)) == set()
    assert busy_adapters(engine_text(running=2, lora_sets=0)) == set()
