"""The agent compatibility matrix: route x streaming x tools x tier, each request sent straight to the
tier's engine and through the gateway (tests/test_agent_compat.py runs it and writes
benchmarks/results/agent_compat.json). This module renders that result as the table in docs/agents.md:

    python benchmarks/agent_compat.py   # rewrites the table between the agent-compat markers
"""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "agent_compat.json"
DOC = ROOT / "docs" / "agents.md"
BEGIN, END = "<!-- agent-compat:begin -->", "<!-- agent-compat:end -->"


def _mark(cell: dict, side: str) -> str:
    outcome = cell[side]
    return "ok" if outcome["ok"] else f"fails ({outcome['why']})"


def render_table(result: dict) -> str:
    lines = [
        "| route | stream | tools | tier | engine | gateway |",
        "|---|---|---|---|---|---|",
    ]
    for cell in result["cells"]:
        lines.append(f"| `{cell['route']}` | {'yes' if cell['stream'] else 'no'} | {cell['tools']} | {cell['tier']} "
                     f"| {_mark(cell, 'engine')} | {_mark(cell, 'gateway')} |")
    lines.append("")
    lines.append(f"{sum(c['gateway']['ok'] for c in result['cells'])}/{len(result['cells'])} cells served through "
                 "the gateway (source: `benchmarks/results/agent_compat.json`, with its commit, date and machine).")
    return "\n".join(lines)


def rewrite_doc(result: dict, doc: Path = DOC) -> None:
    text = doc.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{render_table(result)}\n{END}{tail}")


def doc_table(doc: Path = DOC) -> str:
    return doc.read_text().split(BEGIN, 1)[1].split(END, 1)[0].strip("\n")


if __name__ == "__main__":
    rewrite_doc(json.loads(RESULT.read_text()))
