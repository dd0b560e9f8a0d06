"""Inference economics: price book, exact costs, fleet yield, durable ledger, keys, budgets, limits."""

from .config import (LedgerConfig, LimitsConfig, PricingConfig, ReplicaCost, ResolvedTierPrice,
                     TierPrice)
from .cost import WIRE_ENCODER, Cost, Usage
from .errors import (InsufficientQuota, InvalidApiKey, InvalidPrice, InvalidUsage, KeyNotFound,
                     LedgerError, LimiterUnavailable, PricingError, RateLimited, StoreUnavailable)
from .fleet_cost import FleetCostMeter, FleetYield, ReplicaYield, TierYield
from .price_book import PriceBook

__all__ = [
    "Cost", "FleetCostMeter", "FleetYield", "InsufficientQuota", "InvalidApiKey", "InvalidPrice",
    "InvalidUsage", "KeyNotFound", "LedgerConfig", "LedgerError", "LimiterUnavailable",
    "LimitsConfig", "PriceBook", "PricingConfig", "PricingError", "RateLimited", "ReplicaCost",
    "ReplicaYield", "ResolvedTierPrice", "StoreUnavailable", "TierPrice", "TierYield", "Usage",
    "WIRE_ENCODER",
]
