"""Inference economics: price book, exact costs, fleet yield, durable ledger, keys, budgets, limits,
and the `model: "auto"` choice of the target cheapest per solved task."""

from .advisor import CacheAdvisor, Divergence, KeyCacheReport, common_prefix_len, diagnose
from .budget import BudgetEnforcer, BudgetStatus, Reservation
from .config import (LedgerConfig, LimitsConfig, PricingConfig, ReplicaCost, ResolvedTierPrice,
                     TierPrice)
from .cost import WIRE_ENCODER, Cost, Usage
from .errors import (InsufficientQuota, InvalidApiKey, InvalidPrice, InvalidUsage, KeyNotFound,
                     LedgerError, LimiterUnavailable, PricingError, RateLimited, StoreReset,
                     StoreUnavailable)
from .fleet_cost import FleetCostMeter, FleetYield, ReplicaYield, TierYield
from .journal import Journal
from .keys import ApiKey, CreatedKey, KeyStore
from .ledger import Ledger
from .price_book import PriceBook
from .ratelimit import RateDecision, RateLimiter
from .record import LedgerRecord, Outcome, record_docs
from .report import SuccessRow, UsageRow, export_csv, export_focus_csv, success_report, usage_report
from .stores import LedgerStore, PostgresStore, RedisStore, SQLiteStore
from .target_choice import AUTO_GROUP_BY, AutoRule, Choice, TargetChooser

__all__ = [
    "Cost", "FleetCostMeter", "FleetYield", "InsufficientQuota", "InvalidApiKey", "InvalidPrice",
    "InvalidUsage", "KeyNotFound", "LedgerConfig", "LedgerError", "LimiterUnavailable",
    "LimitsConfig", "PriceBook", "PricingConfig", "PricingError", "RateLimited", "ReplicaCost",
    "PostgresStore", "StoreReset",
    "ReplicaYield", "ResolvedTierPrice", "StoreUnavailable", "TierPrice", "TierYield", "Usage",
    "WIRE_ENCODER", "Journal", "Ledger", "LedgerRecord", "LedgerStore", "Outcome", "RedisStore",
    "SQLiteStore", "ApiKey", "BudgetEnforcer", "BudgetStatus", "CreatedKey", "KeyStore",
    "RateDecision", "RateLimiter", "Reservation", "CacheAdvisor", "Divergence", "KeyCacheReport",
    "common_prefix_len", "diagnose", "record_docs", "SuccessRow", "UsageRow", "export_csv", "export_focus_csv", "success_report", "usage_report",
    "AutoRule", "Choice", "AUTO_GROUP_BY", "TargetChooser",
]
