"""Typed configuration for the pricing package; the lead embeds PricingConfig as `[pricing]`.

Example TOML:

    [pricing.models.default.standard]
    input = "0.50"                 # USD per 1M uncached input tokens
    # cached_input defaults to 0.1 x input, output to 4 x input
    [pricing.models.default.fast]
    input = "1.00"
    [pricing.models.demo.standard]
    input = "0.50"
    cached_input = "0.05"
    output = "2.00"
    [pricing.replicas.standard-0]
    hourly_usd = "1.20"
    [pricing.lanes]                  # batch and flex: a share of each model's standard price
    batch = "0.5"
    flex = "0.5"
    [pricing.adapters.support]       # a LoRA adapter: its base model's prices, plus 10 %
    surcharge = "0.10"
    [pricing.ledger]
    journal_dir = "/var/lib/yieldgate/ledger"
    store = "sqlite"               # or "postgres" (the fleet's record), "redis"
    [pricing.limits]
    on_redis_error = "open"        # or "closed"
"""

from __future__ import annotations

from decimal import Decimal
from typing import Literal

import msgspec

# Common-practice ratios: prompt-cache hits cost a tenth of fresh input, output costs 4x input.
CACHED_INPUT_RATIO = Decimal("0.1")
OUTPUT_RATIO = Decimal("4")
FAST_TIER_MULTIPLIER = Decimal("2")


class TierPrice(msgspec.Struct, forbid_unknown_fields=True):
    """USD per 1M tokens for one (model, tier); unset fields derive from `input`."""

    input: Decimal
    cached_input: Decimal | None = None
    output: Decimal | None = None


class ResolvedTierPrice(msgspec.Struct, frozen=True):
    input: Decimal
    cached_input: Decimal
    output: Decimal


def _default_models() -> dict[str, dict[str, TierPrice]]:
    standard = Decimal("0.50")
    return {"default": {"standard": TierPrice(input=standard),
                        "fast": TierPrice(input=standard * FAST_TIER_MULTIPLIER)}}


class LanePrices(msgspec.Struct, forbid_unknown_fields=True):
    """The batch and flex lanes' price as a share of the standard tier's (input, cached input and
    output alike), for every model without its own `batch` or `flex` entry in `models`."""

    batch: Decimal = Decimal("0.5")
    flex: Decimal = Decimal("0.5")


class ReplicaCost(msgspec.Struct, forbid_unknown_fields=True):
    """What one replica costs to keep running, whether busy or idle."""

    hourly_usd: Decimal
    tier: str | None = None
    model: str | None = None


class AdapterPrice(msgspec.Struct, forbid_unknown_fields=True):
    """A LoRA adapter's price: its base model's for the tier, times (1 + surcharge)."""

    surcharge: Decimal = Decimal("0")


class LedgerConfig(msgspec.Struct, forbid_unknown_fields=True):
    journal_dir: str = "~/.yieldgate/ledger"
    # sqlite: one file, one gateway. postgres: the record for a fleet of gateways (docs/deployment.md).
    # redis: shared, but only as durable as that Redis (a Redis restarted empty gets the journals
    # replayed, which hold records back to their last compaction only).
    store: Literal["sqlite", "redis", "postgres"] = "sqlite"
    sqlite_path: str = ""                 # "" = <journal_dir>/ledger.sqlite3
    postgres_url: str = ""                # "" = the gateway's server.postgres_url
    retention_days: int = 0               # postgres: drop day partitions older than this at start (0: keep)
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "yg:ledger:"
    flush_interval_s: float = 0.2         # how long the flusher waits to batch records
    batch_size: int = 500                 # records per store round trip
    compact_bytes: int = 64 * 1024 * 1024  # truncate the journal once fully flushed and this big
    retry_backoff_s: float = 1.0          # wait between store retries while it is down


class LimitsConfig(msgspec.Struct, forbid_unknown_fields=True):
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "yg:"
    # "open": admit requests when Redis is unreachable (availability over enforcement);
    # "closed": reject them with LimiterUnavailable (enforcement over availability).
    on_redis_error: Literal["open", "closed"] = "open"
    # HMAC pepper for API-key hashes. Empty: the gateway creates a random one in
    # <data_dir>/key-pepper (mode 0600). Gateways on several hosts sharing Redis must share it:
    # set YIELDGATE_PRICING__LIMITS__KEY_PEPPER from a secret store, never TOML in git.
    key_pepper: str = ""
    key_cache_ttl_s: float = 5.0          # revocation reaches every gateway within this time
    reservation_ttl_s: int = 600          # a budget reservation never settled is released after this
    rate_window_s: int = 60


class PricingConfig(msgspec.Struct, forbid_unknown_fields=True):
    # models[model][tier]; the "default" model entry prices unknown model names.
    models: dict[str, dict[str, TierPrice]] = msgspec.field(default_factory=_default_models)
    # The fast tier's premium is billed for a workload class (API x greedy/sampled) only once the
    # gateway has measured its speed-up over the standard tier, on at least fast_min_samples
    # requests of each tier, at fast_min_speedup or more; until then, and below it, fast requests
    # of that class pay the standard price. 0 = always the fast price.
    fast_min_speedup: float = 1.5
    fast_min_samples: int = 20
    lanes: LanePrices = msgspec.field(default_factory=LanePrices)
    replicas: dict[str, ReplicaCost] = msgspec.field(default_factory=dict)
    # adapters[name]; the "default" entry prices adapters not listed; none: the base model's prices.
    adapters: dict[str, AdapterPrice] = msgspec.field(default_factory=dict)
    ledger: LedgerConfig = msgspec.field(default_factory=LedgerConfig)
    limits: LimitsConfig = msgspec.field(default_factory=LimitsConfig)
