"""Exceptions raised by the trainer bridge; each names one way a weight push can fail."""

from __future__ import annotations


class BridgeError(Exception):
    """Base class for every trainer-bridge failure."""


class ChecksumMismatch(BridgeError):
    """A chunk's bytes did not match the checksum its header carried; the update was refused."""


class PushRefused(BridgeError):
    """The engine refused the push: missing or wrong token, or a token rotation without the
    current token. Its weights are untouched."""


class TransferError(BridgeError):
    """The data stream broke (disconnect, timeout, malformed frame, incomplete coverage)."""


class EngineRequestError(BridgeError):
    """An engine HTTP endpoint answered with an error status."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} -> HTTP {status}: {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


class PushFailed(BridgeError):
    """A fan-out push failed on at least one engine; `failures` maps engine URL -> exception."""

    def __init__(self, failures: dict[str, BaseException]) -> None:
        detail = "; ".join(f"{url}: {exc}" for url, exc in failures.items())
        super().__init__(f"push failed on {len(failures)} engine(s): {detail}")
        self.failures = failures


class RolloutFailed(BridgeError):
    """A rollout stopped; `reason` says why, `replica` where (None if before any replica)."""

    def __init__(self, reason: str, replica: str | None = None) -> None:
        super().__init__(f"rollout stopped at {replica or '-'}: {reason}")
        self.reason = reason
        self.replica = replica
