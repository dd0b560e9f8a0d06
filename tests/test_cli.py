"""The `yieldgate` console script as a user runs it: simulate, model make, loadtest, and the
Grafana dashboard's queries against the live stack's /metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
YIELDGATE = shutil.which("yieldgate", path=str(Path(sys.executable).parent)) or "yieldgate"


def run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([YIELDGATE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_simulate_prints_every_policy_and_cache_aware_beats_round_robin():
    out = run("simulate", "--replicas", "4", "--tenants", "8", "--requests", "300", "--rate", "20", "--json")
    assert out.returncode == 0, out.stderr
    results = {r["policy"]: r for r in json.loads(out.stdout)}
    assert set(results) == {"round_robin", "least_loaded", "session", "cache_aware"}
    assert results["cache_aware"]["cached_ratio"] > results["round_robin"]["cached_ratio"]


def test_simulate_refuses_an_unknown_policy_with_exit_2():
    out = run("simulate", "--requests", "10", "--policies", "fastest")
    assert out.returncode == 2 and "unknown routing policy 'fastest'" in out.stderr


def test_model_make_writes_the_same_files_for_the_same_seed(tmp_path):
    a = run("model", "make", "tiny", "--out", str(tmp_path / "a"), "--seed", "3")
    b = run("model", "make", "tiny", "--out", str(tmp_path / "b"), "--seed", "3")
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert a.stdout.strip() == str(tmp_path / "a")  # stdout is the model's path, for scripts
    files = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes() for f in files)
    assert (tmp_path / "a" / "config.json").exists() and (tmp_path / "a" / "tokenizer.json").exists()


def test_loadtest_runs_against_the_stack(stack, tmp_path):
    out = run("loadtest", "-t", stack.gateway_url, "-m", stack.model, "--requests", "6", "--concurrency", "2",
              "--output-tokens", "8", "--no-progress", "--no-html", "--out", str(tmp_path / "lt"), timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert list((tmp_path / "lt").glob("*.json")), out.stdout[-2000:]


def test_every_series_the_grafana_dashboard_queries_exists_in_metrics(stack):
    board = json.loads((ROOT / "examples" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    assert exprs, "the dashboard has no queries"
    names = {re.sub(r"_(bucket|sum|count)$", "", n) for e in exprs for n in re.findall(r"yieldgate_\w+", e)}
    metrics = httpx.get(stack.gateway_url + "/metrics", timeout=30).text
    declared = set(re.findall(r"^# TYPE (\S+) ", metrics, re.M))
    assert names and names <= declared, f"queried but not exported: {sorted(names - declared)}"
