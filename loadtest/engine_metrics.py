"""Before/after scrapes of vLLM's Prometheus /metrics: prefix-cache hits and spec-decode acceptance."""

from __future__ import annotations

import asyncio

import aiohttp
import msgspec
from prometheus_client.parser import text_string_to_metric_families

COUNTERS = (
    "vllm:prefix_cache_queries_total",
    "vllm:prefix_cache_hits_total",
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:request_success_total",
)


class EngineMetricsError(RuntimeError):
    """An engine's /metrics could not be scraped."""


class EngineDelta(msgspec.Struct, kw_only=True):
    """Counter increases over a run, summed over the given engines and all label sets."""

    urls: list[str]
    counters: dict[str, float]

    @property
    def prefix_hit_ratio(self) -> float | None:
        q = self.counters.get("vllm:prefix_cache_queries_total", 0.0)
        return self.counters.get("vllm:prefix_cache_hits_total", 0.0) / q if q else None

    @property
    def spec_acceptance_rate(self) -> float | None:
        d = self.counters.get("vllm:spec_decode_num_draft_tokens_total", 0.0)
        return self.counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / d if d else None

    @property
    def spec_mean_accepted_length(self) -> float | None:
        """1 + accepted/drafts: tokens emitted per verification step, as vLLM reports it."""
        n = self.counters.get("vllm:spec_decode_num_drafts_total", 0.0)
        return 1.0 + self.counters.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) / n if n else None

    def to_dict(self) -> dict:
        return {"urls": self.urls, "counters": self.counters, "prefix_hit_ratio": self.prefix_hit_ratio,
                "spec_acceptance_rate": self.spec_acceptance_rate,
                "spec_mean_accepted_length": self.spec_mean_accepted_length}


def parse_counters(text: str, names: tuple[str, ...] = COUNTERS) -> dict[str, float]:
    wanted = set(names)
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] = out.get(sample.name, 0.0) + float(sample.value)
    return out


def metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if url.endswith("/metrics"):
        return url
    return (url[:-3] if url.endswith("/v1") else url) + "/metrics"


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    try:
        async with session.get(metrics_url(url), timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                raise EngineMetricsError(f"{metrics_url(url)}: HTTP {resp.status}")
            text = await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise EngineMetricsError(f"{metrics_url(url)}: {exc}") from exc
    return parse_counters(text)


async def scrape_all(urls: list[str]) -> dict[str, float]:
    if not urls:
        return {}
    async with aiohttp.ClientSession() as session:
        results = await asyncio.gather(*(scrape(session, u) for u in urls))
    total: dict[str, float] = {}
    for r in results:
        for k, v in r.items():
            total[k] = total.get(k, 0.0) + v
    return total


def delta(urls: list[str], before: dict[str, float], after: dict[str, float]) -> EngineDelta:
    return EngineDelta(urls=urls, counters={k: after.get(k, 0.0) - before.get(k, 0.0) for k in after})
