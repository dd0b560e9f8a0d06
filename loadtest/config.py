"""One typed object for a whole load-test run, loadable from TOML/JSON (the `[loadtest]` section).

    [[loadtest.targets]]
    base_url = "http://127.0.0.1:8000"
    model = "demo"
    [[loadtest.targets]]
    base_url = "http://127.0.0.1:8000"
    model = "demo:fast"
    [loadtest.workload]
    kind = "shared_prefix"
    prefix_tokens = 512
    [loadtest.load]
    kind = "poisson"
    rate = 8
    [loadtest.bounds]
    requests = 200
    [loadtest.slo]
    ttft_ms = 500
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Literal

import msgspec

from .load import Bounds, ConcurrencyLoad, Load
from .price import Price, PriceTable
from .runner import CacheSalt, OnRecord, RunResult, run_compare
from .target import Target
from .workload import SharedPrefixWorkload, Workload


class LoadTestConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    targets: list[Target]
    workload: Workload = msgspec.field(default_factory=SharedPrefixWorkload)
    load: Load = msgspec.field(default_factory=ConcurrencyLoad)
    bounds: Bounds = msgspec.field(default_factory=Bounds)
    slo: dict[str, float] = {}
    prices: dict[str, Price] = {}  # by target label or model; "*" = everyone
    engine_metrics: list[str] = []
    cache_salt: str | None = None  # a salt, or "auto" (fresh per target)
    cache_salt_mode: Literal["prefix", "field", "both"] = "prefix"
    order: Literal["sequential", "interleaved"] = "sequential"
    rounds: int = 4
    out_dir: str | None = None

    @classmethod
    def load_file(cls, path: str | Path) -> "LoadTestConfig":
        p = Path(path)
        raw = tomllib.loads(p.read_text()) if p.suffix == ".toml" else msgspec.json.decode(p.read_bytes())
        return msgspec.convert(raw.get("loadtest", raw), cls)


def run_config(cfg: LoadTestConfig, *, on_record: OnRecord | None = None, on_phase=None) -> list[RunResult]:
    salt: CacheSalt | str | None = None
    if cfg.cache_salt == "auto":
        salt = "auto"
    elif cfg.cache_salt:
        salt = CacheSalt(value=cfg.cache_salt, mode=cfg.cache_salt_mode)
    return run_compare(cfg.targets, cfg.workload, cfg.load, cfg.bounds, order=cfg.order, rounds=cfg.rounds,
                       slo=cfg.slo, prices=PriceTable(prices=cfg.prices) if cfg.prices else None,
                       engine_metrics_urls=cfg.engine_metrics, cache_salt=salt, on_record=on_record,
                       on_phase=on_phase, seed=cfg.workload.seed)
