"""`model: "auto"`'s decision (pricing/target_choice.py) on simulated traffic: Bernoulli targets
with their own success rate per task class and their own cost per request.

- Economics: three targets, none cheapest per solved task in every class; the chooser, exploring
  from nothing, must land near the per-class hindsight oracle and well under any single target.
- Noise drill: two identical targets; after warm-up the incumbent may change in at most
  1 - confidence of the seeded runs (replacing on noise needs a one-sided bound to miss).
- Restart: `load` of the ledger's success rows picks the incumbent the live chooser had.
"""

from __future__ import annotations

import json
import random
import time
from collections import defaultdict
from decimal import Decimal

import msgspec
import pytest

from yieldgate.pricing import AUTO_GROUP_BY, AutoRule, Choice, SuccessRow, TargetChooser

# USD per request (each request's cost varies ±50% around it) and success rate per class.
COST = {"big": 0.003, "small": 0.001, "json-lora": 0.0012}
SUCCESS = {"chat": {"big": 0.90, "small": 0.85, "json-lora": 0.20},
           "json": {"big": 0.90, "small": 0.15, "json-lora": 0.95},
           "code": {"big": 0.85, "small": 0.10, "json-lora": 0.10}}


class Ledger:
    """What the gateway's ledger would hold: per (task class, target) the success report's sums."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0.0, 0, 0, 0.0])

    def add(self, task: str, target: str, usd: float, passed: bool | None) -> None:
        r = self.rows[task, target]
        r[0] += 1
        r[1] += usd
        if passed is not None:
            r[2] += 1
            r[3] += passed
            r[4] += usd

    def success_rows(self) -> list[SuccessRow]:
        return [SuccessRow(group=dict(zip(AUTO_GROUP_BY, k)), requests=r[0], spend_usd=Decimal(repr(r[1])),
                           tasks_graded=r[2], successes=r[3], graded_spend_usd=Decimal(repr(r[4])))
                for k, r in self.rows.items()]


def simulate(chooser: TargetChooser, rng: random.Random, n: int, cost: dict[str, float],
             success: dict[str, dict[str, float]], graded_share: float = 0.5,
             ledger: Ledger | None = None) -> dict:
    """n auto requests, classes uniformly mixed; each request's true outcome counts toward the
    realised $/solved, a `graded_share` of them is fed back as the client's grade."""
    spend = solved = 0.0
    per_class: dict[str, int] = defaultdict(int)
    explored = 0
    classes = list(success)
    for _ in range(n):
        task = rng.choice(classes)
        per_class[task] += 1
        choice = chooser.choose(task)
        explored += choice.explored
        usd = cost[choice.target] * rng.uniform(0.5, 1.5)
        passed = rng.random() < success[task][choice.target]
        spend += usd
        solved += passed
        chooser.observe_cost(task, choice.target, usd)
        graded = rng.random() < graded_share
        if graded:
            chooser.observe_outcome(task, choice.target, passed, usd)
        if ledger is not None:
            ledger.add(task, choice.target, usd, passed if graded else None)
    return {"usd_per_solved": spend / solved, "success_rate": solved / n, "per_class": per_class,
            "explored": explored / n}


def expected(per_class: dict[str, int], pick, cost, success) -> tuple[float, float]:
    """($/solved, success rate) expected of serving each class with pick(class), same class mix."""
    usd = sum(k * cost[pick(c)] for c, k in per_class.items())
    solved = sum(k * success[c][pick(c)] for c, k in per_class.items())
    return usd / solved, solved / sum(per_class.values())


def test_the_targets_make_a_real_choice():
    best = {c: min(COST, key=lambda t: COST[t] / rates[t]) for c, rates in SUCCESS.items()}
    assert len(set(best.values())) == 3, best      # no single target is cheapest per solve everywhere


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_auto_beats_every_single_target_and_nears_the_oracle(seed, record_property):
    chooser = TargetChooser(AutoRule(), list(COST), seed=seed)
    got = simulate(chooser, random.Random(seed), 12_000, COST, SUCCESS)
    mix = got["per_class"]
    oracle, _ = expected(mix, lambda c: min(COST, key=lambda t: COST[t] / SUCCESS[c][t]), COST, SUCCESS)
    singles = {t: expected(mix, lambda c, t=t: t, COST, SUCCESS) for t in COST}
    best_single = min(v[0] for v in singles.values())
    most_accurate = max(v[1] for v in singles.values())
    print(f"\n[auto] seed {seed}: ${got['usd_per_solved']:.6f}/solved, success {got['success_rate']:.3f}, "
          f"explored {got['explored']:.1%}; oracle ${oracle:.6f}, best single ${best_single:.6f}, "
          f"most accurate single {most_accurate:.3f}; incumbents "
          f"{ {c: chooser.incumbent(c) for c in SUCCESS} }")
    record_property("vs_oracle", got["usd_per_solved"] / oracle)
    record_property("vs_best_single", got["usd_per_solved"] / best_single)
    assert got["usd_per_solved"] <= 0.8 * best_single
    assert got["usd_per_solved"] <= 1.1 * oracle
    assert got["success_rate"] >= 0.95 * most_accurate
    assert {c: chooser.incumbent(c) for c in SUCCESS} == \
        {c: min(COST, key=lambda t: COST[t] / SUCCESS[c][t]) for c in SUCCESS}


def incumbent_changes(seed: int, p: float, rule: AutoRule, after: int) -> int:
    """Two identical targets, every request graded: how often the incumbent changes in the
    `after` requests that follow warm-up."""
    rng = random.Random(seed)
    chooser = TargetChooser(rule, ["a", "b"], seed=seed)
    changes, seen, last = 0, 0, None
    while seen < after:
        target = chooser.choose("x").target
        usd = 0.002 * rng.uniform(0.8, 1.2)
        chooser.observe_cost("x", target, usd)
        chooser.observe_outcome("x", target, rng.random() < p, usd)
        now = chooser.incumbent("x")
        if now is not None:
            changes += last is not None and now != last
            last, seen = now, seen + 1
    return changes


@pytest.mark.parametrize("p", [0.2, 0.5, 0.8])
def test_noise_drill_identical_targets_keep_their_incumbent(p, record_property):
    rule = AutoRule()
    runs = 200
    changed = [incumbent_changes(i, p, rule, after=1000) for i in range(runs)]
    share = sum(c > 0 for c in changed) / runs
    record_property("changed_share", share)
    print(f"\n[noise drill] p={p}: incumbent changed in {sum(c > 0 for c in changed)}/{runs} runs "
          f"({share:.1%}), {sum(changed)} changes in all; bound {1 - rule.confidence:.0%}")
    assert share <= 1 - rule.confidence


def test_load_from_the_ledger_picks_the_live_incumbents():
    # Per class: two targets alike within noise and one that never solves anything; which of
    # the alike two the live chooser settled on depends on the run, and a restart must keep it.
    cost = {"a": 0.002, "b": 0.002, "dud": 0.0005}
    success = {f"class-{k}": {"a": 0.5, "b": 0.5, "dud": 0.0} for k in range(12)}
    rule = AutoRule(explore=0.3)     # warm within the run's 300 requests per class
    live = TargetChooser(rule, list(cost), seed=5)
    ledger = Ledger()
    simulate(live, random.Random(5), 12 * 300, cost, success, graded_share=0.8, ledger=ledger)
    rows = ledger.success_rows()
    rows.append(SuccessRow(group={"task": "class-0", "target": "retired"}, requests=99, tasks_graded=99,
                           successes=99))     # a target no longer served: skipped
    restarted = TargetChooser(rule, list(cost), seed=6)
    restarted.load(rows)

    incumbents = {c: live.incumbent(c) for c in success}
    assert None not in incumbents.values() and "dud" not in incumbents.values()
    assert {c: restarted.incumbent(c) for c in success} == incumbents
    assert {c: restarted.choose(c) for c in success} == {c: live.choose(c) for c in success}
    live_state, loaded_state = live.state(), restarted.state()
    for c in success:
        for t in cost:
            a, b = live_state[c]["targets"][t], loaded_state[c]["targets"][t]
            assert (a["requests"], a["graded"], a["successes"]) == (b["requests"], b["graded"], b["successes"])
            assert a["usd_per_solved"] == pytest.approx(b["usd_per_solved"])
    # The restart keeps sticky incumbents, not just the lowest $/solved of the moment.
    sticky = [c for c in success if live_state[c]["targets"][incumbents[c]]["usd_per_solved"]
              > min(v["usd_per_solved"] or float("inf") for v in live_state[c]["targets"].values())]
    assert sticky, "no class kept an incumbent within noise of a cheaper-looking one: the test proves little"


def test_a_class_with_no_label_and_a_row_with_no_task_share_the_default_class():
    rule = AutoRule(min_graded=2)
    chooser = TargetChooser(rule, ["x", "y"])
    chooser.load([SuccessRow(group={"task": None, "target": "x"}, requests=4, spend_usd=Decimal("0.4"),
                             tasks_graded=4, successes=4, graded_spend_usd=Decimal("0.4")),
                  SuccessRow(group={"task": None, "target": "y"}, requests=4, spend_usd=Decimal("0.4"),
                             tasks_graded=4, successes=1, graded_spend_usd=Decimal("0.4"))])
    assert chooser.incumbent() == chooser.incumbent(rule.default_class) == "x"
    assert chooser.choose(None) == Choice("x", "best $/solved 0.1 (n=4)")


def test_decisions_from_nothing_to_warm():
    rule = AutoRule(explore=0.5, min_graded=3)
    chooser = TargetChooser(rule, ["pricey", "cheap", "dud"], seed=0)
    assert chooser.choose("t") == Choice("pricey", "no graded data: cheapest first")
    chooser.observe_cost("t", "pricey", 0.01)
    chooser.observe_cost("t", "cheap", 0.001)
    assert chooser.choose("t").target in ("cheap", "dud")
    assert {c.reason for c in (chooser.choose("t") for _ in range(50)) if c.explored} == {"exploring: 0/3 graded"}
    chooser.observe_outcome("t", "cheap", False)
    assert chooser.state()["t"]["why"] == "nothing solved yet: cheapest first"
    for _ in range(3):
        chooser.observe_outcome("t", "pricey", True, 0.01)
        chooser.observe_outcome("t", "dud", False, 0.0001)
    chooser.observe_outcome("t", "cheap", True, 0.001)
    assert chooser.state()["t"]["why"] == "warming up: best $/solved so far 0.002 (n=2)"
    chooser.observe_outcome("t", "cheap", False, 0.001)
    # Warm: "dud" is cheapest of all but never solved a task, so it never wins.
    assert chooser.incumbent("t") == "cheap"
    choices = {chooser.choose("t") for _ in range(50)}
    assert choices == {Choice("cheap", "best $/solved 0.003 (n=3)")}
    json.dumps(chooser.state())      # the admin view is JSON as it is


def test_a_challenger_cheaper_beyond_noise_replaces_the_incumbent():
    chooser = TargetChooser(AutoRule(min_graded=20), ["a", "b"])
    for _ in range(40):
        chooser.observe_outcome("t", "a", True, 0.0024)
    for k in range(20):
        chooser.observe_outcome("t", "b", k % 2 == 0, 0.001)
    assert chooser.incumbent("t") == "a"           # b: $0.002/solved on 20 tasks vs $0.0024, within noise
    steps = 0
    while chooser.incumbent("t") == "a":          # traffic naming b keeps it learning
        chooser.observe_outcome("t", "b", steps % 2 == 0, 0.001)
        steps += 1
        assert steps < 200
    print(f"\n[replace] b took over after {20 + steps} graded tasks at 5/6 of a's $/solved")
    b = chooser.state()["t"]["targets"]["b"]
    assert chooser.choose("t") == Choice("b", f"best $/solved {b['usd_per_solved']:.4g} (n={b['graded']})")


def test_same_seed_same_choices_and_the_rule_is_validated():
    def run(seed: int) -> list[str]:
        chooser = TargetChooser(AutoRule(explore=0.3), ["a", "b", "c"], seed=seed)
        return [chooser.choose("t").target for _ in range(200)]
    assert run(7) == run(7)
    assert len(set(run(7))) == 3
    for bad in ({"explore": 1.5}, {"min_graded": 0}, {"confidence": 1.0}, {"confidance": 0.9}):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, AutoRule)
    with pytest.raises(ValueError):
        TargetChooser(AutoRule(), ["a", "a"])


def test_choose_cpu_time_ten_targets_twenty_classes():
    """Measured, not asserted (benchmarks/auto_decision.py records it): `choose` is a dict lookup
    and a random draw, the decision being made on each observation."""
    targets = [f"t{i}" for i in range(10)]
    classes = [f"c{j}" for j in range(20)]
    chooser = TargetChooser(AutoRule(), targets, seed=0)
    rng = random.Random(0)
    for c in classes:
        for i, t in enumerate(targets):
            for _ in range(25):
                chooser.observe_cost(c, t, 0.001 * (i + 1))
                chooser.observe_outcome(c, t, rng.random() < 0.3 + 0.05 * i, 0.001 * (i + 1))
    n = 100_000
    started = time.process_time()
    for k in range(n):
        chooser.choose(classes[k % 20])
    choose_us = (time.process_time() - started) / n * 1e6
    started = time.process_time()
    for k in range(2000):
        chooser.observe_outcome(classes[k % 20], targets[k % 10], k % 2 == 0, 0.002)
    observe_us = (time.process_time() - started) / 2000 * 1e6
    print(f"\n[auto decision] 10 targets x 20 classes: choose {choose_us:.2f} us CPU, "
          f"observe_outcome (re-decides the class) {observe_us:.1f} us CPU")
