"""The gateway image, built the way a machine without any container registry can: a Debian root
filesystem from mmdebstrap, wheels downloaded beforehand, `podman build --network=none`
(deploy/images/build-offline.sh); then run as the chart runs it: non-root, read-only root
filesystem, the chart's rendered yieldgate.toml, the Secret values as YIELDGATE_* variables.

Opt-in (YIELDGATE_TEST_IMAGE_BUILD=1): from nothing the build takes longer than a CI run can spare
on 2 cores (docs/kubernetes.md). Skipped with the reason otherwise; never passed without building.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from needs import missing

ROOT = Path(__file__).resolve().parents[1]
TAG = "localhost/yieldgate-gateway:test"
PODMAN = ["podman", "--runtime", "runc"]
# podman's default rlimits exceed this host's hard limits (see deploy/images/build-offline.sh).
ULIMITS = ["--ulimit", "nofile={0}:{0}".format(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
           "--ulimit", "nproc=4096:4096"]
OPT_IN = "YIELDGATE_TEST_IMAGE_BUILD"

pytestmark = pytest.mark.skipif(
    os.environ.get(OPT_IN) != "1",
    reason=f"the offline image build takes minutes from nothing; set {OPT_IN}=1 to run it (docs/kubernetes.md)")


@pytest.fixture(scope="module")
def image() -> str:
    for tool in ("podman", "runc", "mmdebstrap"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            missing(f"{tool} not installed (apt-get install podman runc mmdebstrap)")
    if os.geteuid() != 0:
        missing("the offline image build runs podman and mmdebstrap as root")
    work = Path(sys.prefix) / "share" / "yieldgate-test-tools" / "image-build"
    started = time.monotonic()
    done = subprocess.run(["bash", str(ROOT / "deploy/images/build-offline.sh"), TAG],
                          env={**os.environ, "WORK": str(work)}, capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    print(f"\nimage build: {time.monotonic() - started:.0f} s; {done.stderr.strip().splitlines()[-1]}")
    return TAG


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout)


def test_image_runs_as_non_root_with_no_secret_and_no_vllm(image):
    (info,) = json.loads(podman("image", "inspect", image).stdout)
    config = info["Config"]
    assert config["User"] == "10001:10001"
    env = dict(e.split("=", 1) for e in config["Env"])
    assert not [k for k in env if k.startswith("YIELDGATE_") and k != "YIELDGATE_HOME"], env
    assert env["PYTHONHASHSEED"] == "0"
    probe = podman("run", "--rm", "--network=none", *ULIMITS, "--entrypoint", "python3", image, "-c",
                   "import os, importlib.util as u; print(os.getuid(), u.find_spec('vllm') is None, "
                   "u.find_spec('yieldgate.gateway') is not None)")
    assert probe.stdout.split() == ["10001", "True", "True"], probe.stderr
    size_mb = info["Size"] / 1e6
    print(f"\ngateway image: {size_mb:.0f} MB")


def test_image_serves_the_charts_config(image, tmp_path):
    """The chart's rendered config and secrets, a read-only root filesystem, no network: the
    gateway starts and answers its liveness probe; readiness is 503 (no engine can be found)."""
    import test_kubernetes_chart as chart

    helm = chart.helm_binary()
    objects = chart.render(helm, "-f", str(chart.CHART / "ci" / "cpu-demo-values.yaml"))
    case = chart.Rendered(chart.CHART / "ci" / "cpu-demo-values.yaml", {}, objects)
    text, pod_env, _ = chart.pod_config(case)  # less the keys still pending on this branch
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "yieldgate.toml").write_text(text)
    # No nameserver reachable: discovery fails (and keeps an empty fleet) without a packet leaving.
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    env = [a for name, value in pod_env.items() for a in ("-e", f"{name}={value}")]
    from yieldgate.serving.demo_model import ensure_demo_model

    # What the chart's init container writes to /models/demo (there as uid 10001; here a copy
    # the container's uid can read).
    model = Path(shutil.copytree(ensure_demo_model(), tmp_path / "demo"))
    for path in [model, *model.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    data = tmp_path / "data"  # the pod's emptyDir, writable by its uid (fsGroup)
    data.mkdir()
    os.chown(data, 10001, 10001)
    name = f"yieldgate-image-test-{os.getpid()}"
    run = podman("run", "-d", "--name", name, "--network=none", "--read-only", *ULIMITS,
                 "--tmpfs", "/tmp", "-v", f"{data}:/var/lib/yieldgate",
                 "-v", f"{tmp_path / 'etc'}:/etc/yieldgate:ro", "-v", f"{tmp_path / 'resolv.conf'}:/etc/resolv.conf:ro", "-v", f"{model}:/models/demo:ro",
                 *env, image)
    assert run.returncode == 0, run.stderr
    try:
        got = None
        for _ in range(60):
            got = podman("exec", name, "python3", "-c",
                         "import urllib.request as r, urllib.error as e\n"
                         "for p in ('/healthz', '/readyz'):\n"
                         "    try: print(p, r.urlopen('http://127.0.0.1:8000' + p, timeout=2).status)\n"
                         "    except e.HTTPError as x: print(p, x.code)\n")
            if got.returncode == 0:
                break
            time.sleep(1)
        assert got is not None and got.returncode == 0, podman("logs", name).stdout + podman("logs", name).stderr
        assert got.stdout.split() == ["/healthz", "200", "/readyz", "503"], got.stdout
        logs = podman("logs", name)
        assert "no tokenizer" not in logs.stdout + logs.stderr  # it read the mounted model's tokenizer
    finally:
        podman("rm", "-f", name)
