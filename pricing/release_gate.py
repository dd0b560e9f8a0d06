"""Intelligence per dollar as a release gate: an outcome rule over two versions' success rows
(the ledger's success report over the same period) that promotes a candidate version or rolls
it back. The adapter canary (gateway/adapter_canary.py) applies it."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from .report import SuccessRow

Verdict = Literal["promote", "rollback", "wait"]


class OutcomeRule(msgspec.Struct, forbid_unknown_fields=True):
    """When the candidate is good enough to serve everyone, or bad enough to stop."""

    min_graded: Annotated[int, Meta(ge=1)] = 20                  # graded tasks per version first
    max_success_drop: Annotated[float, Meta(ge=0, le=1)] = 0.0   # candidate rate >= stable rate - this
    max_cost_ratio: Annotated[float, Meta(gt=0)] = 1.1           # candidate $/success <= stable's × this


def verdict(stable: SuccessRow, candidate: SuccessRow, rule: OutcomeRule) -> tuple[Verdict, str]:
    """-> (verdict, why). A candidate with no success at all never passes."""
    if min(stable.tasks_graded, candidate.tasks_graded) < rule.min_graded:
        return "wait", (f"graded {candidate.tasks_graded} candidate / {stable.tasks_graded} stable tasks; "
                        f"the rule needs {rule.min_graded} each")
    rates = f"success rate {candidate.success_rate:.3f} vs {stable.success_rate:.3f}"
    if not candidate.successes or candidate.success_rate < (stable.success_rate or 0.0) - rule.max_success_drop:
        return "rollback", rates
    if stable.usd_per_success is not None and candidate.usd_per_success is not None \
            and candidate.usd_per_success > stable.usd_per_success * Decimal(str(rule.max_cost_ratio)):
        return "rollback", f"$ per success {candidate.usd_per_success:.6g} vs {stable.usd_per_success:.6g}"
    return "promote", rates + (f", $ per success {candidate.usd_per_success:.6g} vs {stable.usd_per_success:.6g}"
                               if stable.usd_per_success is not None else "")
