"""Exceptions raised by the trainer bridge; each names one way a weight push can fail."""

from __future__ import annotations

from yieldgate.serving import EngineCallFailed, EngineRefused


class BridgeError(Exception):
    """Base class for every trainer-bridge failure."""


class ChecksumMismatch(BridgeError):
    """A chunk's bytes did not match the checksum its header carried; the update was refused."""


class PushRefused(BridgeError):
    """The engine refused the push: missing or wrong token, or a token rotation without the
    current token. Its weights are untouched."""


class TransferError(BridgeError):
    """The data stream broke (disconnect, timeout, malformed frame, incomplete coverage)."""


class EngineRequestError(BridgeError, EngineCallFailed):
    """An engine HTTP endpoint answered the trainer's client with an error status."""


# An engine's refusal of a push token, from either client (the trainer's or EngineControl).
REFUSALS = (PushRefused, EngineRefused)


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


class WeightsRequestError(BridgeError):
    """The weight orchestrator refuses a request as it stands; the admin API answers with its
    message, `param` and `code`."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class InvalidWeightsRequest(WeightsRequestError):
    """Malformed or impossible as asked (unknown tier, reserved version, nothing staged)."""


class RolloutConflict(WeightsRequestError):
    """The fleet's state forbids it now (a rollout runs, no healthy replica, nothing stored)."""


class NoSuchRollout(WeightsRequestError):
    """No rollout (or no engine of it) by that id is waiting for a push."""


class AdapterPushRefused(BridgeError):
    """The gateway refused an adapter push (checksum, format, shapes, version conflict); the
    version that served before still serves. `status` and `code` are its HTTP answer's."""

    def __init__(self, status: int, code: str | None, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
