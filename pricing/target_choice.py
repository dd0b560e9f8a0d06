"""`model: "auto"`: per task class, the target (model, tier or adapter) with the lowest expected
$ per solved task, learned from what each finished request cost and the clients' graded outcomes.

The rule, per task class:
- A target's $/solved = its spend per graded task / its success rate. A target that has solved
  nothing has no $/solved and never wins.
- Warming up (some target has fewer than `min_graded` graded tasks): a fraction `explore` of the
  requests goes to the least-graded of those targets, the rest to the lowest $/solved so far
  (the cheapest target while nothing is solved).
- Warm: the incumbent keeps the traffic until another target is cheaper per solved task beyond
  noise: its pessimistic $/solved (Wilson lower bound on its success rate at `confidence`) below
  the incumbent's optimistic one (Wilson upper bound). Replacing on noise needs one of those two
  one-sided bounds to miss, each a 1 - `confidence` event; the spend per task is taken as known,
  as in the release gate (pricing/release_gate.py): it hardly varies, the success rate does.
- An incumbent chosen afresh (at warm-up, after a replacement, after `load`) is the most-graded
  target that no other beats beyond noise: the one auto traffic has been using, so a restart that
  reloads the ledger's counts lands on the same target.
Once warm, auto traffic explores no more; a target judged on its first `min_graded` tasks learns
more only from traffic that names it.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from statistics import NormalDist
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from .release_gate import wilson
from .report import SuccessRow

# The ledger's success report grouped by these feeds `TargetChooser.load`.
AUTO_GROUP_BY = ("task", "target")
INF = math.inf


class AutoRule(msgspec.Struct, forbid_unknown_fields=True):
    """How `model: "auto"` learns which target is cheapest per solved task."""

    explore: Annotated[float, Meta(ge=0, le=1)] = 0.1       # share of requests for warming-up targets
    min_graded: Annotated[int, Meta(ge=1)] = 20               # graded tasks per target and class first
    confidence: Annotated[float, Meta(gt=0.5, lt=1)] = 0.95   # one-sided, of each bound
    default_class: Annotated[str, Meta(min_length=1)] = "unlabelled"


class Choice(msgspec.Struct, frozen=True):
    """One decision; `reason` is short ASCII, fit for the `x-yieldgate-auto` response header."""

    target: str
    reason: str
    explored: bool = False


class _Tally:
    """One target in one task class."""

    __slots__ = ("requests", "spend", "graded", "successes", "graded_spend", "priced")

    def __init__(self) -> None:
        self.requests = 0
        self.spend = 0.0          # USD, every finished request
        self.graded = 0
        self.successes = 0
        self.graded_spend = 0.0   # USD of the graded tasks whose spend was given
        self.priced = 0           # graded tasks whose spend was given

    def usd_per_task(self) -> float | None:
        # A task can be a session of several requests: its own spend when known, else the mean
        # request's (grading is assumed independent of cost).
        if self.priced:
            return self.graded_spend / self.priced
        return self.spend / self.requests if self.requests else None


class _Class:
    __slots__ = ("tallies", "incumbent", "choice", "explore")

    def __init__(self, n_targets: int) -> None:
        self.tallies = [_Tally() for _ in range(n_targets)]
        self.incumbent: int | None = None    # set only once warm
        self.choice: Choice                  # served unless exploring
        self.explore: tuple[Choice, ...] = ()  # one of them, with probability rule.explore


class TargetChooser:
    """Picks a target per request for `model: "auto"`; `observe_*` feed it, `choose` is a lookup
    and one random draw (the decision is recomputed per class on every observation)."""

    def __init__(self, rule: AutoRule, targets: Sequence[str], seed: int | None = None) -> None:
        if not targets:
            raise ValueError("the chooser needs at least one target")
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets repeat: {list(targets)}")
        self.rule = rule
        self.targets = tuple(targets)
        self._index = {t: i for i, t in enumerate(self.targets)}
        self._z = NormalDist().inv_cdf(rule.confidence)
        self._rng = random.Random(seed)
        self._classes: dict[str, _Class] = {}

    # -- the request path ----------------------------------------------------------------------

    def choose(self, task_class: str | None = None) -> Choice:
        c = self._classes.get(task_class or self.rule.default_class) or self._add(task_class)
        if c.explore and self._rng.random() < self.rule.explore:
            return c.explore[0] if len(c.explore) == 1 else c.explore[self._rng.randrange(len(c.explore))]
        return c.choice

    def observe_cost(self, task_class: str | None, target: str, usd: float) -> None:
        """Every finished request of `target` in the class, graded or not; unknown targets are ignored."""
        i = self._index.get(target)
        if i is None:
            return
        c = self._classes.get(task_class or self.rule.default_class) or self._add(task_class)
        t = c.tallies[i]
        t.requests += 1
        t.spend += usd
        self._decide(c)

    def observe_outcome(self, task_class: str | None, target: str, passed: bool,
                        usd: float | None = None) -> None:
        """One graded task; `usd` is its spend when known (a session's is that of all its requests)."""
        i = self._index.get(target)
        if i is None:
            return
        c = self._classes.get(task_class or self.rule.default_class) or self._add(task_class)
        t = c.tallies[i]
        t.graded += 1
        t.successes += bool(passed)
        if usd is not None:
            t.graded_spend += usd
            t.priced += 1
        self._decide(c)

    # -- restarts and the admin view -----------------------------------------------------------

    def load(self, rows: Iterable[SuccessRow]) -> None:
        """Replace everything learned with the ledger's success report grouped by AUTO_GROUP_BY
        (rows of the same task and target add up; targets not served here are skipped)."""
        self._classes.clear()
        for row in rows:
            i = self._index.get(row.group.get("target") or "")
            if i is None:
                continue
            name = row.group.get("task") or self.rule.default_class
            c = self._classes.get(name)
            if c is None:
                c = self._classes[name] = _Class(len(self.targets))
            t = c.tallies[i]
            t.requests += row.requests
            t.spend += float(row.spend_usd)
            t.graded += row.tasks_graded
            t.successes += row.successes
            t.graded_spend += float(row.graded_spend_usd)
            t.priced += row.tasks_graded
        for c in self._classes.values():
            self._decide(c)

    def incumbent(self, task_class: str | None = None) -> str | None:
        """The warm incumbent of a class; None while it warms up or when nothing is solved."""
        c = self._classes.get(task_class or self.rule.default_class)
        return None if c is None or c.incumbent is None else self.targets[c.incumbent]

    def state(self) -> dict[str, Any]:
        """Per class, JSON-able: each target's counts and estimates, whom auto traffic gets and why."""
        out: dict[str, Any] = {}
        for name, c in sorted(self._classes.items()):
            targets = {}
            for target, t in zip(self.targets, c.tallies):
                point, optimistic, pessimistic = self._estimates(t)
                targets[target] = {
                    "requests": t.requests, "spend_usd": t.spend, "graded": t.graded,
                    "successes": t.successes,
                    "success_rate": t.successes / t.graded if t.graded else None,
                    "usd_per_task": t.usd_per_task(), "usd_per_solved": _finite(point),
                    # at `confidence`: the Wilson bounds on the success rate, as $/solved
                    "usd_per_solved_bounds": [_finite(optimistic), _finite(pessimistic)],
                }
            out[name] = {"incumbent": self.incumbent(name), "serves": c.choice.target, "why": c.choice.reason,
                         "exploring": [e.target for e in c.explore], "targets": targets}
        return out

    # -- the decision --------------------------------------------------------------------------

    def _add(self, task_class: str | None) -> _Class:
        c = self._classes[task_class or self.rule.default_class] = _Class(len(self.targets))
        self._decide(c)
        return c

    def _estimates(self, t: _Tally) -> tuple[float, float, float]:
        """-> ($/solved, optimistic, pessimistic); inf where nothing is solved or no cost is known."""
        cost = t.usd_per_task()
        if cost is None or not t.successes:
            return INF, INF, INF
        low, high = wilson(t.successes, t.graded, self._z)
        return cost * t.graded / t.successes, cost / high, cost / low if low > 0 else INF

    def _decide(self, c: _Class) -> None:
        rule, tallies = self.rule, c.tallies
        warm = all(t.graded >= rule.min_graded for t in tallies)
        estimates = [self._estimates(t) for t in tallies]
        solved = [i for i, e in enumerate(estimates) if e[0] < INF]
        if not solved:
            c.incumbent = None
            leader = self._cheapest(tallies)
            c.choice = Choice(self.targets[leader], "no graded data: cheapest first"
                              if not any(t.graded for t in tallies) else "nothing solved yet: cheapest first")
        elif not warm:
            c.incumbent = None
            leader = min(solved, key=lambda i: estimates[i][0])
            c.choice = Choice(self.targets[leader], f"warming up: best $/solved so far "
                              f"{estimates[leader][0]:.4g} (n={tallies[leader].graded})")
        else:
            # Beaten = another target's pessimistic $/solved is below this one's optimistic.
            # The lowest pessimistic value is never beaten, so someone always stands.
            by_pessimism = sorted(solved, key=lambda i: estimates[i][2])
            best, runner_up = by_pessimism[0], by_pessimism[1] if len(by_pessimism) > 1 else None

            def beaten(i: int) -> bool:
                other = runner_up if i == best else best
                return other is not None and estimates[other][2] < estimates[i][1]

            if c.incumbent is None or c.incumbent not in solved or beaten(c.incumbent):
                standing = [i for i in solved if not beaten(i)]
                c.incumbent = max(standing, key=lambda i: (tallies[i].graded, -estimates[i][0]))
            leader = c.incumbent
            point = estimates[leader][0]
            lowest = min(estimates[i][0] for i in solved)
            reason = (f"best $/solved {point:.4g} (n={tallies[leader].graded})" if point <= lowest else
                      f"$/solved {point:.4g} (n={tallies[leader].graded}), none lower beyond "
                      f"{100 * rule.confidence:g}% confidence")
            c.choice = Choice(self.targets[leader], reason)
        # Exploration feeds the least-graded of the targets short of min_graded (the leader gets
        # its share anyway); ties are drawn at random, as requests in flight are not counted yet.
        short = [i for i, t in enumerate(tallies) if t.graded < rule.min_graded and i != leader]
        fewest = min((tallies[i].graded for i in short), default=0)
        c.explore = tuple(Choice(self.targets[i], f"exploring: {fewest}/{rule.min_graded} graded", True)
                          for i in short if tallies[i].graded == fewest) if rule.explore > 0 else ()

    def _cheapest(self, tallies: list[_Tally]) -> int:
        """Lowest known spend per task; a target with none yet after the known ones, in list order.
        One graded min_graded times without a success goes last: it never wins while another can."""
        def key(i: int) -> tuple[bool, float, int]:
            t = tallies[i]
            cost = t.usd_per_task()
            return t.graded >= self.rule.min_graded and not t.successes, INF if cost is None else cost, i
        return min(range(len(tallies)), key=key)


def _finite(x: float) -> float | None:
    return x if x < INF else None
