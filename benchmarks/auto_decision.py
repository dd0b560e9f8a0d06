"""CPU time of `model: "auto"`'s decision (pricing/target_choice.py) with 10 targets × 20 task classes.

    python benchmarks/auto_decision.py [--repeat 5] [--quick] [--out PATH]

`choose` runs on every auto request; the goal is ≤ 200 µs of CPU per call. Half the classes are
warm (every target past min_graded), half still warming up, so both branches of `choose` (the
cached choice, and the exploration draw) are timed. `observe_outcome` re-decides its class and
runs after a request, off its latency; it is recorded too. Every run is kept; the figures are the
median and range over the runs (benchmarks/harness.py's format). Writes
benchmarks/results/auto_decision.json.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import harness  # benchmarks/harness.py, beside this script
from yieldgate.pricing import AutoRule, TargetChooser

ROOT = Path(__file__).resolve().parents[1]
TARGETS = [f"target-{i}" for i in range(10)]
CLASSES = [f"class-{j}" for j in range(20)]
GOAL_US = 200.0


def trained_chooser(seed: int = 0) -> TargetChooser:
    rule = AutoRule()
    chooser = TargetChooser(rule, TARGETS, seed=seed)
    rng = random.Random(seed)
    for j, task in enumerate(CLASSES):
        graded = rule.min_graded + 10 if j % 2 == 0 else rule.min_graded // 2   # odd classes warm up
        for i, target in enumerate(TARGETS):
            usd = 0.0005 * (i + 1)
            for _ in range(graded):
                chooser.observe_cost(task, target, usd)
                chooser.observe_outcome(task, target, rng.random() < 0.3 + 0.06 * i, usd)
    return chooser


def one_run(calls: int, observations: int) -> dict:
    chooser = trained_chooser()
    order = [CLASSES[k % len(CLASSES)] for k in range(calls)]
    cpu, wall = time.process_time(), time.perf_counter()
    explored = sum(chooser.choose(task).explored for task in order)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    cpu_obs = time.process_time()
    for k in range(observations):
        chooser.observe_outcome(CLASSES[k % len(CLASSES)], TARGETS[k % len(TARGETS)], k % 2 == 0, 0.002)
    cpu_obs = time.process_time() - cpu_obs
    return {"calls": calls, "explored": explored, "choose_cpu_us": cpu / calls * 1e6,
            "choose_wall_us": wall / calls * 1e6, "observations": observations,
            "observe_cpu_us": cpu_obs / observations * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="fewer calls per run")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "auto_decision.json"))
    args = ap.parse_args()
    calls, observations = (20_000, 1_000) if args.quick else (400_000, 20_000)
    rec = harness.Recording("auto_decision", ["pricing/target_choice.py", "pricing/release_gate.py",
                                              "benchmarks/auto_decision.py"], out=Path(args.out))
    runs = harness.repeat({"choose": lambda: one_run(calls, observations)}, n=args.repeat)
    summary = {key: harness.summarize(r[key] for r in runs)
               for key in ("choose_cpu_us", "choose_wall_us", "observe_cpu_us")}
    summary["goal_choose_cpu_us"] = GOAL_US
    summary["goal_met"] = summary["choose_cpu_us"]["max"] <= GOAL_US
    rec.write(runs=runs, summary=summary,
              setup=f"{len(TARGETS)} targets x {len(CLASSES)} task classes (half warm, half warming up), "
                    f"{calls:,} choose calls and {observations:,} observe_outcome calls per run, one thread")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
