"""The built wheel installs one import namespace: only `yieldgate/` and its dist-info land in
site-packages (a trainer that installs yieldgate for `push()` must not get a module named `cache`)."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_only_the_yieldgate_namespace(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "dist"), str(ROOT)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("yieldgate-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/", 1)[0] for n in names}
    assert tops == {"yieldgate", f"{wheel.name.split('-')[0]}-{wheel.name.split('-')[1]}.dist-info"}
    assert "yieldgate/gateway/static/dashboard.html" in names
    assert "yieldgate/serving/data/corpus.txt" in names
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "yieldgate = yieldgate.gateway.cli:main" in entry_points
    assert "yieldgate = yieldgate.trainer_bridge.plugin:register" in entry_points

    # A fresh venv without dependencies: what lands in site-packages is the wheel's files alone.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    py = env_dir / "bin" / "python"
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    before = set(Path(site).iterdir())
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q", str(wheel)],
                   check=True, timeout=300)
    landed = {p.name for p in set(Path(site).iterdir()) - before}
    assert landed == {"yieldgate", wheel.name.split("-")[0] + "-" + wheel.name.split("-")[1] + ".dist-info"}, landed
    # The namespace imports from the installed copy; its faces' __init__ need lazy_loader alone.
    import shutil

    import lazy_loader

    deps = tmp_path / "deps"
    shutil.copytree(Path(lazy_loader.__file__).parent, deps / "lazy_loader")
    out = subprocess.run([str(py), "-c", "import yieldgate.gateway as m; print(m.__file__)"],
                         check=True, capture_output=True, text=True, cwd=tmp_path,
                         env={"PYTHONPATH": str(deps), "PATH": "/usr/bin:/bin"}).stdout
    assert out.startswith(site)
