"""docs/architecture.md's module map names every module of every package, in that package's rows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "serving", "cache", "pricing", "trainer_bridge", "loadtest")


def named_in_map() -> dict[str, set[str]]:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Module map"):]
    table = table[:table.index("\n## ")]
    named: dict[str, set[str]] = {}
    package = ""
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] == "package" or set(cells[0]) <= {"-"} and cells[0]:
            continue
        package = cells[0] or package
        named.setdefault(package, set()).update(re.findall(r"`([\w/.]+)`", cells[1]))
    return named


def test_every_module_is_in_the_module_map():
    named = named_in_map()
    missing = []
    for package in PACKAGES:
        folder = ROOT / package
        modules = [f.name for f in folder.glob("*.py") if f.name != "__init__.py"]
        modules += [d.name + "/" for d in folder.iterdir() if (d / "__init__.py").exists()]
        missing += [f"{package}/{m}" for m in sorted(modules) if m not in named.get(package, set())]
    assert not missing, f"docs/architecture.md's module map does not name: {', '.join(missing)}"


def test_the_map_names_no_module_that_is_gone():
    gone = [f"{package}/{m}" for package, names in named_in_map().items() for m in sorted(names)
            if m.endswith((".py", "/")) and not (ROOT / package / m).exists()]
    assert not gone, f"docs/architecture.md's module map names modules that do not exist: {', '.join(gone)}"
