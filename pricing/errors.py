"""Specific exception types raised by the pricing package.

The gateway maps them to HTTP: InsufficientQuota -> 429 insufficient_quota, RateLimited -> 429
rate_limit_exceeded (with Retry-After), InvalidApiKey -> 401, LimiterUnavailable -> 503.
"""

from __future__ import annotations

from decimal import Decimal


class PricingError(Exception):
    """Base class for every error raised by yieldgate.pricing."""


class InvalidUsage(PricingError, ValueError):
    """Token counts that cannot be priced (negative, or cached_tokens > prompt_tokens)."""


class InvalidPrice(PricingError, ValueError):
    """A configured price is negative or not representable exactly."""


class InvalidApiKey(PricingError):
    """The presented secret matches no active key (unknown, malformed or revoked)."""


class KeyNotFound(PricingError, KeyError):
    """An admin operation named a key id that does not exist."""


class InsufficientQuota(PricingError):
    """A hard budget would be exceeded by this request's maximum possible cost."""

    def __init__(self, key_id: str, budget_usd: Decimal, spent_usd: Decimal, reserved_usd: Decimal,
                 requested_usd: Decimal) -> None:
        self.key_id = key_id
        self.budget_usd = budget_usd
        self.spent_usd = spent_usd
        self.reserved_usd = reserved_usd
        self.requested_usd = requested_usd
        super().__init__(
            f"key {key_id}: budget ${budget_usd} exhausted (spent ${spent_usd}, "
            f"reserved ${reserved_usd}, this request up to ${requested_usd})"
        )


class RateLimited(PricingError):
    """An RPM or TPM limit is exceeded; retry_after_s says when the window has room again."""

    def __init__(self, key_id: str, limit: str, retry_after_s: float) -> None:
        self.key_id = key_id
        self.limit = limit  # "rpm" or "tpm"
        self.retry_after_s = retry_after_s
        super().__init__(f"key {key_id}: {limit} limit reached, retry after {retry_after_s:.2f}s")


class LimiterUnavailable(PricingError):
    """Redis is unreachable and the policy is on_redis_error = "closed"."""


class LedgerError(PricingError):
    """The ledger cannot accept records (not started, closed, or journal locked by another process)."""


class StoreUnavailable(LedgerError):
    """The ledger store backend failed; records stay in the journal and are retried."""


class StoreReset(StoreUnavailable):
    """The ledger store lost its data (its mark changed, e.g. a Redis restarted empty): the ledger
    replays its whole journal into it."""
