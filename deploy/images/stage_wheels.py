"""Wheels for an offline image build, from the Python environment that runs this script: each
distribution yieldgate needs at run time (its requirements, transitively, markers evaluated for the
image's Python), packed from its installed files as an uncompressed wheel. The image then holds
exactly the versions this environment runs and was tested with, and staging takes seconds: no
package index is asked (one `pip download` per requirement this environment lacks, such as one only
an older Python needs).

    python deploy/images/stage_wheels.py WHEEL_DIR yieldgate-0.1.0-py3-none-any.whl [--python 3.11.2]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from importlib.metadata import Distribution, PackageNotFoundError, distribution
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(wheel: Path, python: str) -> tuple[list[Distribution], list[Requirement]]:
    """-> installed distributions the wheel needs, and requirements no installed one meets."""
    env = {"python_full_version": python, "python_version": ".".join(python.split(".")[:2])}
    with zipfile.ZipFile(wheel) as zf:
        metadata = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        requires = [line.split(":", 1)[1].strip() for line in zf.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    found: dict[str, Distribution] = {}
    missing: list[Requirement] = []
    seen: set[tuple[str, str]] = set()   # (distribution, extra) whose requirements are queued
    todo = [(Requirement(r), "") for r in requires]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        name = canonicalize_name(req.name)
        try:
            dist = found.get(name) or distribution(name)
        except PackageNotFoundError:
            missing.append(req)
            continue
        if not req.specifier.contains(dist.version, prereleases=True):
            sys.exit(f"installed {name} {dist.version} does not meet {req}")
        found[name] = dist
        for wanted in {"", *req.extras} - {e for n, e in seen if n == name}:
            seen.add((name, wanted))
            todo += [(Requirement(r), wanted) for r in dist.requires or []]
    return list(found.values()), missing


def pack(dist: Distribution, out: Path) -> Path:
    """The distribution's installed files as a wheel (stored: pip unpacks it at copy speed)."""
    info = next(f for f in dist.files or [] if f.name == "WHEEL" and f.parent.name.endswith(".dist-info"))
    tags = [line.split(":", 1)[1].strip().split("-") for line in info.read_text().splitlines()
            if line.startswith("Tag:")]
    # Every tag, as a compressed tag set (py2.py3-none-any): pip takes the file if any one fits.
    tag = "-".join(".".join(dict.fromkeys(t[i] for t in tags)) for i in range(3))
    name = canonicalize_name(dist.metadata["Name"]).replace("-", "_")
    path = out / f"{name}-{dist.version}-{tag}.whl"
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as zf:
        for f in dist.files or []:
            # Scripts outside site-packages are made again by pip; bytecode is made where it runs.
            if f.parts[0] == ".." or "__pycache__" in f.parts or f.name in ("RECORD", "INSTALLER", "REQUESTED"):
                continue
            zf.write(f.locate(), str(f))
        zf.writestr(f"{info.parent}/RECORD", "")
    tmp.rename(path)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("wheel", type=Path, help="the yieldgate wheel")
    p.add_argument("--python", default="3.11.2", help="the image's Python (for requirement markers)")
    args = p.parse_args()
    dists, missing = closure(args.wheel, args.python)
    for dist in dists:
        pack(dist, args.out)
    if missing:
        # Without the marker: it holds for the image's Python, not for this one.
        wanted = [f"{r.name}{r.specifier}" for r in missing]
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--no-deps",
                        "-d", str(args.out), *wanted], check=True)
    print(f"{len(dists)} installed distributions packed, {len(missing)} downloaded ({', '.join(map(str, missing))})")


if __name__ == "__main__":
    main()
