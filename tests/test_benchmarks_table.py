"""The README's results table is what `benchmarks/run_all.py --table` prints from the committed
results, so a changed result file and a stale README figure cannot land together."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
run_all = importlib.util.module_from_spec(_spec)
sys.modules["run_all"] = run_all  # its dataclasses look their module up
_spec.loader.exec_module(run_all)


def readme_table() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index("| benchmark | today | goal | reproduce |")
    end = next(i for i in range(start, len(lines)) if not lines[i].startswith("|"))
    return "\n".join(lines[start:end])


def test_readme_results_table_is_printed_from_the_result_files():
    assert readme_table() == run_all.table(), \
        "README.md's results table is stale: paste the output of python benchmarks/run_all.py --table"


def test_every_row_reads_a_result_or_names_what_asserts_it():
    for b in run_all.BENCHMARKS:
        figure = b.figure()
        assert "(no result" not in figure, (b.name, figure)
        assert b.files or "(asserted)" in figure, f"{b.name}: a figure needs a result file or a test asserting it"
        for name in b.files:
            assert (run_all.RESULTS / f"{name}.json").is_file(), name
