"""The README's results table is what `benchmarks/run_all.py --table` prints from the committed
results: a changed result, a result whose code changed since it was measured (shown as stale), and a
README that says otherwise cannot land together. Every figure is computed from a result file."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
_spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
sys.modules["run_all"] = run_all  # its dataclasses look their module up
_spec.loader.exec_module(run_all)
harness = run_all.harness


def test_readme_results_table_is_printed_from_the_result_files():
    assert run_all.readme_table() == run_all.table(), \
        "README.md's results table is stale: paste the output of python benchmarks/run_all.py --table"


def test_check_passes_and_lists_the_stale_rows():
    assert run_all.check() == []
    done = subprocess.run([sys.executable, "benchmarks/run_all.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    for name, _ in run_all.stale():
        assert f"stale: {name}:" in done.stdout


def test_every_result_records_its_environment_in_one_spelling():
    for b in run_all.BENCHMARKS:
        assert b.files, f"{b.name}: every row is computed from a result file"
        for name in b.files:
            if not (run_all.RESULTS / f"{name}.json").is_file():
                continue  # shown as "no result recorded", and listed by --check
            meta = run_all.load(name)["meta"]
            assert harness.meta_problems(meta) == [], (name, harness.meta_problems(meta))
            for path in meta["measures"]:
                assert (ROOT / path).exists(), f"{name}: measures {path}, which is not in the repository"


def test_every_row_reads_its_result():
    for b in run_all.BENCHMARKS:
        figure = run_all.figure(b)
        assert "(no result" not in figure, (b.name, figure)


def _repo(tmp_path: Path):
    def git(*args: str) -> str:
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path,
                              check=True, capture_output=True, text=True).stdout.strip()

    git("init", "-q")
    (tmp_path / "gateway").mkdir()
    (tmp_path / "gateway" / "proxy.py").write_text("a = 1\n")
    (tmp_path / "docs.md").write_text("x\n")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    return tmp_path, git("rev-parse", "HEAD"), git


def test_a_result_goes_stale_when_its_measured_code_changes(tmp_path):
    repo, measured_at, git = _repo(tmp_path)
    meta = {"commit": measured_at, "measures": ["gateway/"], "dirty": False}
    assert harness.freshness(meta, repo=repo).current
    (repo / "docs.md").write_text("y\n")  # not measured code: the result stays current
    git("commit", "-qam", "docs")
    assert harness.freshness(meta, repo=repo).current
    (repo / "gateway" / "proxy.py").write_text("a = 2\n")
    git("commit", "-qam", "code")
    fresh = harness.freshness(meta, repo=repo)
    assert not fresh.current and fresh.changed == ["gateway/"]
    assert "**stale**: gateway/ changed since" in fresh.describe()
    assert harness.in_history(measured_at, repo=repo) and not harness.in_history("0" * 40, repo=repo)
    # A result whose measured commit was not recorded is never shown as current.
    assert not harness.freshness({**meta, "commit": "not recorded", "recorded_in": measured_at}, repo=repo).current
    assert not harness.freshness({**meta, "commit": "0" * 40}, repo=repo).current


def test_check_fails_when_the_readme_shows_a_stale_row_as_current(tmp_path, monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("# x\n\n" + run_all.table() + "\n")
    assert run_all.check(readme) == []
    current = [b for b in run_all.BENCHMARKS if b.files and "current" in run_all.measured(b)]
    if not current:
        pytest.skip("no row is current: nothing the README could claim wrongly")
    row = current[0]
    real = run_all.load

    def older(name: str) -> dict:
        doc = real(name)
        if name in row.files:  # measured before the first commit touching its code
            doc = {**doc, "meta": {**doc["meta"], "commit": harness.git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]}}
        return doc

    monkeypatch.setattr(run_all, "load", older)
    assert "stale" in run_all.measured(row)
    assert any("differs" in p for p in run_all.check(readme))


@pytest.mark.parametrize("name,bad", [
    ("chaos_faults", {"unary_failed": 2}), ("chaos_redis", {"failed": 1}), ("chaos_gateway", {"in_ledger_once": 3}),
    ("tokenizer_parity", {"identical": 1}), ("agent_corpus", {"identical": 1})])
def test_asserted_rows_are_computed_from_what_their_test_recorded(monkeypatch, name, bad):
    """No fixed strings: a record with a failure shows it, in bold."""
    row = next(b for b in run_all.BENCHMARKS if name in b.files)
    counts = {"in_flight_at_kill": 3, "unary": 10, "unary_failed": 0, "streams": 5, "streams_cut_with_error_event": 1,
              "streams_left_by_client_at_stop": 0, "gateway_resends_after_closed_keepalive": 0,
              "gateway_retries_on_another_replica": 3, "requests": 10,
              "answered_during_outage": 4, "keyed_during_outage": 2, "failed": 0, "errors": 0,
              "ledger_matches_clients": 10, "answered": 10, "in_ledger_once": 10, "prompts": 10, "identical": 10}
    monkeypatch.setattr(run_all, "load", lambda n: {"meta": {}, "counts": counts})
    good = row.figure()
    assert "**" not in good, good
    monkeypatch.setattr(run_all, "load", lambda n: {"meta": {}, "counts": {**counts, **bad}})
    assert "**" in row.figure() and row.figure() != good


def test_summaries_are_median_and_range_of_every_run():
    runs = harness.repeat({"a": lambda: {"x": 1.0}, "b": lambda: {"x": 2.0}}, n=3)
    assert [r["target"] for r in runs] == ["a", "b"] * 3  # interleaved
    assert harness.by_target(runs, "x") == {"a": {"n": 3, "median": 1.0, "min": 1.0, "max": 1.0},
                                            "b": {"n": 3, "median": 2.0, "min": 2.0, "max": 2.0}}
    assert harness.summarize([3, 1, 2, 10]) == {"n": 4, "median": 2.5, "min": 1.0, "max": 10.0}
    assert run_all.median_range([1.0, 2.0, 9.0], lambda v: f"{v:.1f}") == "2.0 [1.0–9.0]"
    json.dumps(runs)


def _summary(*values: float) -> dict:
    return harness.summarize(values)


def test_rows_of_results_the_harness_writes(monkeypatch):
    """The figures of the harness's format (every run kept, median and range), for results that are
    re-measured with it: fast tier with its same-engine control, engine crash and multihost with
    their re-sends counted apart."""
    fast = {"runs": [{}, {}, {}], "summary": {
        name: {"speedup_e2e_output_tps_p50": _summary(*s), "control_e2e_output_tps_p50": _summary(1.05, 1.1, 1.2),
               "speedup_e2e_output_tps_p50_corrected": _summary(*s),
               "served_by": {"standard": {"standard-0": 30}, "fast": {replica: 30}}}
        for name, s, replica in (("code_edit_greedy", (2.5, 2.9, 3.1), "fast-0"), ("chat", (0.9, 1.0, 1.1), "standard-0"),
                                 ("code_edit_greedy@c4", (1.5, 1.9, 2.1), "fast-0"))}}
    crash = {"runs": [{"streams": 100, "crashes": [{"served_by_other_tier": 10}]}] * 3, "summary": {
        "requests": _summary(900, 1000, 1100), "failed": _summary(0, 0, 1), "streams_cut": _summary(1, 2, 3),
        "gateway_resent": _summary(4, 5, 6), "admitted_s_standard": _summary(100, 120, 130),
        "admitted_s_fast": _summary(150, 160, 170)}}
    multihost = {"runs": [{"drills": {"sigkill": {"failed": 2}, "dns": {"failed": 0}}}] * 3, "summary": {
        "requests": _summary(190, 200, 210), "failed": _summary(2, 2, 3), "refused_and_resent": _summary(1, 3, 4),
        "dns_admit_s": _summary(4, 4.3, 5), "dns_leave_s": _summary(3, 3.5, 4), "sigterm_drain_s": _summary(3, 3.5, 4),
        "sigkill_failed": _summary(2, 2, 3)}}
    docs = {"fast_vs_standard": fast, "engine_crash": crash, "multihost": multihost}
    monkeypatch.setattr(run_all, "load", lambda name: docs[name])
    text = run_all.fast_vs_standard()
    assert "**1.90× [1.50×–2.10×]** (conc. 4)" in text and "2.90× [2.50×–3.10×] (conc. 1)" in text
    assert "fast target served by fast-0: code_edit_greedy, code_edit_greedy@c4; standard-0: chat" in text
    assert "same-engine control, which came out 1.10×" in text
    text = run_all.engine_crash()
    assert "**0 [0–1] failed**" in text and "5 [4–6] re-sent by the gateway" in text
    text = run_all.multihost()
    assert "3 [1–4] refused connections re-sent" in text and "0 failed" in text


def test_a_recording_keeps_its_environment_and_every_run(tmp_path):
    rec = harness.Recording("x", ["cache/"], command="python benchmarks/x.py", out=tmp_path / "x.json")
    runs = harness.repeat({"a": lambda: {"v": 1.0}}, n=3)
    doc = rec.write(runs=runs, summary={"v": harness.by_target(runs, "v")}, setup="three passes")
    assert json.loads((tmp_path / "x.json").read_text()) == doc
    meta = doc["meta"]
    assert harness.meta_problems(meta) == []
    assert meta["commit"] == harness.git("rev-parse", "HEAD").stdout.strip() and isinstance(meta["dirty"], bool)
    assert meta["date"].endswith("Z") and meta["command"] == "python benchmarks/x.py" and meta["setup"] == "three passes"
    assert all(isinstance(meta["load_avg_1m"][k], float) for k in ("before", "after"))
    assert set(meta["versions"]) == {"python", "vllm", "torch"} and len(doc["runs"]) == 3
    # A script writing its own document takes the same meta in one call, its own notes apart.
    other = harness.meta(["cache/"], setup="s", mode="full")
    assert harness.meta_problems(other) == [] and other["notes"] == {"mode": "full"}
    assert other["load_avg_1m"]["before"] == harness.NOT_RECORDED
