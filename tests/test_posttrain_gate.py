"""The statistical canary gate (pricing/release_gate.py) and the task checkers
(trainer_bridge/tasks.py). No engine: the sabotage drill on a real engine is
tests/test_posttrain_loop.py.

The noise drill: two versions with the same success probability, graded as the gateway's timer
would see them (a look after every few graded tasks per version, up to the rule's max_graded);
the gate must promote neither in at least 95% of seeded trials."""

from __future__ import annotations

import json
import random
from decimal import Decimal

import pytest

from yieldgate.pricing.release_gate import CanaryGateConfig, OutcomeRule, rate_difference_bounds, verdict, wilson
from yieldgate.pricing.report import SuccessRow
from yieldgate.trainer_bridge.tasks import FAMILIES, check, check_fields, check_number, check_tool_call, \
    number_words, task_split

RULE = CanaryGateConfig().rule       # the gateway's default: one-sided 99.9% bounds per look
COST_PER_TASK = Decimal("0.0001")


def row(graded: int, successes: int, cost_per_task: Decimal = COST_PER_TASK) -> SuccessRow:
    spend = cost_per_task * graded
    return SuccessRow(group={}, tasks_graded=graded, successes=successes, graded_spend_usd=spend,
                      success_rate=successes / graded if graded else None,
                      usd_per_success=spend / successes if successes else None)


def sequential_trial(rng: random.Random, p_stable: float, p_canary: float, rule: OutcomeRule,
                     share: float = 0.25, look_every: int = 4) -> tuple[str, int]:
    """One canary as the timer sees it: graded tasks arrive, `share` of them on the canary; a look
    after every `look_every` new canary grades. -> (final verdict, canary tasks graded)."""
    s = [0, 0]
    c = [0, 0]
    while True:
        for _ in range(look_every):
            c[0] += 1
            c[1] += rng.random() < p_canary
            for _ in range(round((1 - share) / share)):
                s[0] += 1
                s[1] += rng.random() < p_stable
        decision, _ = verdict(row(s[0], s[1]), row(c[0], c[1]), rule)
        if decision != "wait":
            return decision, c[0]


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5, 0.8])
def test_noise_drill_identical_versions_are_not_promoted(p, record_property):
    rng = random.Random(f"noise-{p}")
    trials = 400
    verdicts = [sequential_trial(rng, p, p, RULE)[0] for _ in range(trials)]
    promoted = verdicts.count("promote") / trials
    record_property("promote_rate", promoted)
    print(f"\n[noise drill] p={p}: promoted {verdicts.count('promote')}/{trials} ({promoted:.1%}), "
          f"rolled back {verdicts.count('rollback')}/{trials}")
    assert promoted <= 0.05


def test_a_clearly_better_canary_is_promoted_and_a_broken_one_rolled_back_quickly():
    rng = random.Random("power")
    better = [sequential_trial(rng, 0.2, 0.6, RULE) for _ in range(200)]
    assert sum(v == "promote" for v, _ in better) / 200 >= 0.95
    broken = [sequential_trial(rng, 0.5, 0.0, RULE) for _ in range(200)]
    assert all(v == "rollback" for v, _ in broken)
    # A canary that answers nothing right is stopped on its first look with enough grades.
    assert max(n for _, n in broken) <= RULE.min_graded + 8


def test_the_bounds():
    low, high = wilson(0, 10, 1.96)
    assert low == 0.0 and 0.27 < high < 0.28                # Wilson's 0/10 upper bound, 95% two-sided
    low, high = rate_difference_bounds((56, 70), (48, 80), 1.96)   # Newcombe (1998), example (a)
    assert (round(low, 4), round(high, 4)) == (0.0524, 0.3339)


@pytest.mark.parametrize("stable, candidate, expected", [
    (row(10, 5), row(5, 5), "wait"),                          # too few graded on the candidate
    (row(40, 8), row(40, 30), "promote"),                     # 20% -> 75%: better beyond noise
    (row(40, 8), row(40, 12), "wait"),                        # 20% -> 30%: within noise
    (row(40, 30), row(40, 8), "rollback"),                    # worse beyond noise
    (row(40, 20), row(40, 20, COST_PER_TASK * 4), "rollback"),  # as good, 4x the $ per success
    (row(40, 20), row(40, 30, COST_PER_TASK * 4), "rollback"),  # better, but far costlier per success
    (row(200, 50), row(200, 55), "rollback"),                 # never shown better by max_graded
])
def test_the_statistical_rule(stable, candidate, expected):
    decision, why = verdict(stable, candidate, RULE)
    assert decision == expected, why


def test_checkers():
    assert check_number("85", "85") and check_number("85", "The answer is 85.") and check_number("1250", "1,250")
    assert not check_number("85", "47 + 38 = 85") and not check_number("85", "eighty-five")
    want = json.dumps({"name": "Maria", "age": 34, "city": "Lisbon"})
    assert check_fields(want, 'Sure: ```json\n{"name": "maria", "age": "34", "city": "Lisbon"}\n```')
    assert not check_fields(want, '{"name": "Maria", "age": 43, "city": "Lisbon"}')
    assert not check_fields(want, '{"name": "Maria", "city": "Lisbon"}') and not check_fields(want, "Maria, 34")
    call = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}})
    assert check_tool_call(call, '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "Celsius"}}')
    assert check_tool_call(call, '{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"unit\\": \\"celsius\\"}"}')
    assert not check_tool_call(call, '{"name": "convert_currency", "arguments": {"city": "Oslo", "unit": "celsius"}}')
    assert not check_tool_call(call, '{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert number_words(347) == "three hundred forty-seven" and number_words(90) == "ninety"


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_task_splits_are_seeded_held_out_and_gradable(name):
    train, held = task_split(name, "train", 100), task_split(name, "eval", 30)
    assert task_split(name, "train", 100) == train and task_split(name, "eval", 30, seed=1) != held
    assert not {t.prompt for t in train} & {t.prompt for t in held}
    assert len({t.prompt for t in train}) == 100
    for t in held[:20]:   # the expected answer passes its own checker, a wrong one does not
        good = t.expected if name not in ("json_extract", "tool_call") else f"Here: {t.expected}"
        assert check(t, good)
        assert not check(t, "I don't know.")
