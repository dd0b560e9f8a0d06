"""What the routing benchmarks share (routing.py, agent_routing.py, adapter_routing.py,
emulated_fleet.py): the demo model's words per token and engine model, a gateway config with every
engine as a replica per policy, a Redis of a gateway's own, the bench's prefix-index keys in Redis,
prefix-cache resets, the p90 difference with its bootstrap interval, and
result meta. Scripts import these from here, never from each other."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec

from yieldgate.cache.simulator import EngineModel
from yieldgate.loadtest.stats import percentile

# Demo model: byte-level BPE with 1,024 tokens needs ~0.42 words per token (OpenAI's 0.75 is for
# big vocabularies), so "600 tokens" in the workload means about 600 demo-model tokens.
WORDS_PER_TOKEN = 0.42
# The CPU demo engines, roughly (prefill ~0.4 ms/token under the shared 2-core machine's load).
DEMO_ENGINE = EngineModel(prefill_s_per_token=4e-4, step_s=0.02, decode_s_per_seq=0.004, max_running=64,
                          max_batched_tokens=2048, kv_capacity_blocks=65536)


# The gateway always opens Redis. agent_routing.py and adapter_routing.py keep their gateways'
# prefix-index keys in this DB under their own replica names, and delete them before each gateway so
# every run starts cold; this benchmark gives each gateway a Redis of its own (own_redis).
REDIS_URL = "redis://127.0.0.1:6379/14"
REPLICA_PREFIX = "rtb-"


def clear_bench_index(redis_url: str = REDIS_URL) -> None:
    import redis

    r = redis.Redis.from_url(redis_url)
    try:
        keys = list(r.scan_iter(match=f"yg:prefix:demo:r:{REPLICA_PREFIX}*"))
        if keys:
            r.delete(*keys)
        fields = [f for f in r.hkeys("yg:prefix:demo:capacity") if f.decode().startswith(REPLICA_PREFIX)]
        if fields:
            r.hdel("yg:prefix:demo:capacity", *fields)
    finally:
        r.close()


@contextmanager
def own_redis(workdir: Path) -> Iterator[str]:
    """A Redis server of its own on loopback, for one gateway: gateways that share a Redis share its
    prefix-index channel, and each applies the others' writes, work a lone gateway does not do
    (and that the CPU per request would count)."""
    import proxy_rig

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from multihost import RedisServer  # tests/multihost.py, as benchmarks/multihost.py uses it

    port = proxy_rig.free_port()
    server = RedisServer(workdir / f"redis-{port}", "127.0.0.1", port)
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def parse_policy(label: str) -> tuple[str, dict[str, float]]:
    """"cache_aware+queued_request_blocks=8" -> ("cache_aware", {"queued_request_blocks": 8.0}):
    a policy with tier tuning overrides, so tunings run side by side like policies."""
    name, *pairs = label.split("+")
    return name, {k: float(v) for k, v in (p.split("=", 1) for p in pairs)}


def two_replica_config(policy: str, engines: list[tuple[str, str]], model_path: str,
                       redis_url: str = REDIS_URL, tag: str = "", data_dir: str = "") -> Any:
    """One `standard` tier with every engine as a replica."""
    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig

    name, overrides = parse_policy(policy)
    tier = msgspec.convert({"policy": name, **overrides}, TierConfig, strict=False)
    replicas = [ReplicaConfig(name=f"{REPLICA_PREFIX}{tag}{i}", tier="standard", url=url, kv_events_endpoint=kv)
                for i, (url, kv) in enumerate(engines)]
    return Config(server=ServerConfig(redis_url=redis_url, data_dir=data_dir),
                  fleet=FleetConfig(model="demo", model_path=model_path, block_size=32, replicas=replicas,
                                    tiers={"standard": tier}, health_interval_s=1.0,
                                    scrape_interval_s=1.0))


def _reset_prefix_cache(url: str) -> None:
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(url + "/reset_prefix_cache", method="POST"), timeout=30).read()


def bootstrap_p90_diff(a: list[float], b: list[float], resamples: int = 2000, seed: int = 0) -> dict:
    """p90(a) - p90(b) with a 90% bootstrap interval (both samples resampled independently) and
    the share of resamples where p90(a) <= p90(b). One run's p90 on this 2-core machine moves
    by tens of percent, so a policy comparison is a difference with an interval, not two numbers."""
    import random

    rng = random.Random(seed)
    diffs = sorted(percentile(rng.choices(a, k=len(a)), 90) - percentile(rng.choices(b, k=len(b)), 90)
                   for _ in range(resamples))
    return {"diff_ms": percentile(a, 90) - percentile(b, 90),
            "ci90_ms": [percentile(diffs, 5), percentile(diffs, 95)],
            "p_not_worse": sum(d <= 0 for d in diffs) / resamples}


MEASURES = ["gateway/", "cache/", "serving/", "pricing/", "loadtest/", "benchmarks/routing.py",
            "benchmarks/fleet_rig.py"]


def result_meta(command: str, load: str, measures: list[str] = MEASURES) -> dict:
    import harness  # benchmarks/harness.py, beside this script

    return harness.meta(measures, setup=load, command=command)
