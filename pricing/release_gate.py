"""Intelligence per dollar as a release gate: an outcome rule over two versions' success rows
(the ledger's success report over the same period) that promotes a candidate version or rolls
it back. The adapter canary (gateway/adapter_canary.py) applies it, by hand and on a timer.

Two forms of the rule (docs/posttraining.md#the-gate):
- point estimates (`confidence` unset): the candidate's success rate and $ per success against
  the stable version's, as measured;
- statistical (`confidence` set): promote only when a one-sided Newcombe (Wilson score) bound on
  the difference of success rates says the candidate is better beyond noise; roll back when it
  says worse beyond noise, when its $ per success is above the stable version's even at the
  bounds most favourable to it, or when `max_graded` tasks each have not shown it better.
"""

from __future__ import annotations

import math
from decimal import Decimal
from statistics import NormalDist
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
    # Statistical form: the one-sided confidence of each bound (e.g. 0.99); None = point estimates.
    confidence: Annotated[float, Meta(gt=0.5, lt=1)] | None = None
    # Statistical form: with this many graded tasks per version and no promotion, roll back.
    max_graded: Annotated[int, Meta(ge=1)] = 400
    # Statistical form: promote only if the success rate is higher by more than this beyond noise.
    min_gain: Annotated[float, Meta(ge=0, lt=1)] = 0.0


def verdict(stable: SuccessRow, candidate: SuccessRow, rule: OutcomeRule) -> tuple[Verdict, str]:
    """-> (verdict, why). A candidate with no success at all never passes."""
    if min(stable.tasks_graded, candidate.tasks_graded) < rule.min_graded:
        return "wait", (f"graded {candidate.tasks_graded} candidate / {stable.tasks_graded} stable tasks; "
                        f"the rule needs {rule.min_graded} each")
    if rule.confidence is not None:
        return _bounded_verdict(stable, candidate, rule)
    rates = f"success rate {candidate.success_rate:.3f} vs {stable.success_rate:.3f}"
    if not candidate.successes or candidate.success_rate < (stable.success_rate or 0.0) - rule.max_success_drop:
        return "rollback", rates
    if stable.usd_per_success is not None and candidate.usd_per_success is not None \
            and candidate.usd_per_success > stable.usd_per_success * Decimal(str(rule.max_cost_ratio)):
        return "rollback", f"$ per success {candidate.usd_per_success:.6g} vs {stable.usd_per_success:.6g}"
    return "promote", rates + (f", $ per success {candidate.usd_per_success:.6g} vs {stable.usd_per_success:.6g}"
                               if stable.usd_per_success is not None else "")


def wilson(successes: int, n: int, z: float) -> tuple[float, float]:
    """Wilson score interval of a proportion at normal quantile `z` -> (low, high); (0, 1) for n = 0."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def rate_difference_bounds(candidate: tuple[int, int], stable: tuple[int, int], z: float) -> tuple[float, float]:
    """Newcombe's hybrid score bounds (his method 10) on p_candidate - p_stable from
    (successes, graded) of each; each bound is one-sided at `z`."""
    (s1, n1), (s2, n2) = candidate, stable
    p1, p2 = s1 / n1, s2 / n2
    l1, u1 = wilson(s1, n1, z)
    l2, u2 = wilson(s2, n2, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def _bounded_verdict(stable: SuccessRow, candidate: SuccessRow, rule: OutcomeRule) -> tuple[Verdict, str]:
    z = NormalDist().inv_cdf(rule.confidence)
    cs, cn, ss, sn = candidate.successes, candidate.tasks_graded, stable.successes, stable.tasks_graded
    low, high = rate_difference_bounds((cs, cn), (ss, sn), z)
    pct = f"{rule.confidence:.1%}"
    rates = (f"success {cs}/{cn} vs {ss}/{sn}, difference {cs / cn - ss / sn:+.3f} "
             f"({pct} one-sided bounds {low:+.3f} .. {high:+.3f})")
    if high < 0:
        return "rollback", rates + ": worse beyond noise"
    # $ per success = graded spend per task / success rate; the spend per task hardly varies, the
    # success rate does: bound it with the Wilson bounds most favourable to the candidate.
    cost_c = float(candidate.graded_spend_usd) / cn
    cost_s = float(stable.graded_spend_usd) / sn
    c_high, s_low = wilson(cs, cn, z)[1], wilson(ss, sn, z)[0]
    best_c = cost_c / c_high if c_high > 0 else math.inf
    worst_s = cost_s / s_low if s_low > 0 else math.inf
    if cost_s > 0 and best_c > worst_s * rule.max_cost_ratio:
        return "rollback", rates + (f"; $ per success at least {best_c:.6g} vs at most {worst_s:.6g}: "
                                    "costlier beyond noise")
    point_c = cost_c * cn / cs if cs else math.inf
    point_s = cost_s * sn / ss if ss else math.inf
    if low > rule.min_gain and (cost_s == 0 or point_c <= point_s * rule.max_cost_ratio):
        return "promote", rates + f"; $ per success {point_c:.6g} vs {point_s:.6g}: better beyond noise"
    if min(cn, sn) >= rule.max_graded:
        return "rollback", rates + f": not better beyond noise after {rule.max_graded} graded tasks each"
    return "wait", rates + ": within noise"


class CanaryGateConfig(msgspec.Struct, forbid_unknown_fields=True):
    """`[canary]`: the gateway judges every adapter canary by itself every `evaluate_s` seconds."""

    evaluate_s: Annotated[float, Meta(ge=0)] = 30.0     # 0 = only by hand (POST .../canary/evaluate)
    # One-sided 99.9% per look: the timer looks again and again as grades arrive, and the chance of
    # promoting on noise grows with every look (tests/test_posttrain_gate.py measures the whole).
    rule: OutcomeRule = msgspec.field(default_factory=lambda: OutcomeRule(confidence=0.999, max_graded=200))
