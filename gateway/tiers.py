"""Which tier serves a request: OpenAI's `service_tier` field or a `:fast` model suffix."""

from __future__ import annotations

from .errors import InvalidRequest

STANDARD = "standard"
FAST = "fast"
FAST_SUFFIX = ":fast"
# Lanes (gateway/lanes.py): served by the standard tier behind interactive requests, at their own price.
FLEX = "flex"
BATCH = "batch"

_BY_SERVICE_TIER = {None: STANDARD, "auto": STANDARD, "default": STANDARD, "flex": STANDARD,
                    "priority": FAST}
# What the response's `service_tier` says, in OpenAI's vocabulary.
RESPONSE_SERVICE_TIER = {STANDARD: "default", FAST: "priority"}


def response_service_tier(tier: str, lane: str) -> str:
    """The answer's `service_tier`: "flex" for the flex lane, else the serving tier's name."""
    return FLEX if lane == FLEX else RESPONSE_SERVICE_TIER[tier]


def resolve_tier(model: str, service_tier: str | None) -> tuple[str, str]:
    """Return (served model name, tier). The suffix wins over the field when both are given."""
    if model.endswith(FAST_SUFFIX):
        return model[: -len(FAST_SUFFIX)], FAST
    try:
        return model, _BY_SERVICE_TIER[service_tier]
    except KeyError:
        raise InvalidRequest(
            f"Invalid service_tier {service_tier!r}: expected one of auto, default, flex, priority.",
            param="service_tier", code="invalid_value",
        ) from None
