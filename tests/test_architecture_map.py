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


# -- public faces ------------------------------------------------------------------------------
# Every package re-exports its public API in `__init__.py` (`__all__`). The gateway's and serving's
# faces are the only door other packages use; they load lazily, because every vLLM engine imports
# serving (its polling plugin) and the CLI must answer without the web application.
FACED = ("gateway", "serving")
LAZY = ("gateway", "serving")


def test_every_package_has_a_face_whose_names_resolve():
    import importlib

    for package in PACKAGES:
        face = importlib.import_module(f"yieldgate.{package}")
        names = vars(face).get("__all__")
        assert names, f"yieldgate.{package} has no __all__"
        assert len(names) == len(set(names)), f"yieldgate.{package}.__all__ names something twice"
        missing = [n for n in names if not hasattr(face, n)]
        assert not missing, f"yieldgate.{package}.__all__ names what it does not have: {missing}"


def test_lazy_faces_load_no_module_until_a_name_is_used():
    import subprocess
    import sys

    for package in LAZY:
        code = (f"import sys, yieldgate.{package}; "
                f"print(sorted(m for m in sys.modules if m.startswith('yieldgate.{package}.')))")
        loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                check=True, env={"PATH": "/usr/bin:/bin"}).stdout.strip()
        assert loaded == "[]", f"importing yieldgate.{package} loaded {loaded}"


def _imports_from(path: Path) -> list[tuple[str, str, int]]:
    """(module, name, line) of every absolute `from yieldgate.X import name` / `import yieldgate.X`."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("yieldgate."):
            found += [(node.module, a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name.startswith("yieldgate.")]
    return found


def test_other_packages_meet_the_gateway_and_serving_through_their_faces():
    import importlib

    faces = {p: set(importlib.import_module(f"yieldgate.{p}").__all__) for p in FACED}
    wrong = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module, name, line in _imports_from(path):
                target = module.split(".")[1]
                if target == package or target not in faces:
                    continue
                where = f"{path.relative_to(ROOT)}:{line}"
                if module != f"yieldgate.{target}":
                    wrong.append(f"{where} reaches into {module}")
                elif name not in faces[target]:
                    wrong.append(f"{where} imports {name!r}, which yieldgate.{target}.__all__ does not name")
    assert not wrong, "\n".join(wrong)
