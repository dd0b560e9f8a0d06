"""The gateway image, built the way a machine without any container registry can: a Debian root
filesystem from mmdebstrap, wheels of this environment's packages, `podman build --network=none`
(deploy/images/build-offline.sh); then run as the chart runs it: non-root, read-only root
filesystem, the chart's rendered yieldgate.toml, the Secret values as YIELDGATE_* variables, on the
host's loopback only.

Needs podman, runc and mmdebstrap, as root (`scripts/dev test` installs them under CI=true).
Without them the tests skip with the reason; under CI=true they fail. Never passed without building.
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

import httpx
import psutil
import pytest

from needs import missing

ROOT = Path(__file__).resolve().parents[1]
TAG = "localhost/yieldgate-gateway:test"
PODMAN = ["podman", "--runtime", "runc"]
# podman's default rlimits exceed this host's hard limits (see deploy/images/build-offline.sh).
ULIMITS = ["--ulimit", "nofile={0}:{0}".format(resource.getrlimit(resource.RLIMIT_NOFILE)[1]),
           "--ulimit", "nproc=4096:4096"]
PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 960


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
                          env={**os.environ, "WORK": str(work), "PYTHON": sys.executable},
                          capture_output=True, text=True, timeout=900)
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
    """The chart's rendered config and secrets, a read-only root filesystem, the host's network
    namespace with the gateway bound to 127.0.0.1: it answers its liveness probe from the host,
    readiness is 503 (no engine can be found), and its process runs as uid 10001."""
    import test_kubernetes_chart as chart

    helm = chart.helm_binary()
    objects = chart.render(helm, "-f", str(chart.CHART / "ci" / "cpu-demo-values.yaml"))
    case = chart.Rendered(chart.CHART / "ci" / "cpu-demo-values.yaml", {}, objects)
    text, pod_env = chart.gateway_toml(case), chart.gateway_env(case)
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "yieldgate.toml").write_text(text)
    # Only loopback: the gateway listens on 127.0.0.1, and names resolve through a nameserver on
    # 127.0.0.1 that nothing answers, so discovery and Redis find nothing and no packet leaves.
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.1\n")
    pod_env.update(YIELDGATE_SERVER__HOST="127.0.0.1", YIELDGATE_SERVER__PORT=str(PORT))
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
    run = podman("run", "-d", "--name", name, "--network=host", "--read-only", *ULIMITS,
                 "--tmpfs", "/tmp", "-v", f"{data}:/var/lib/yieldgate",
                 "-v", f"{tmp_path / 'etc'}:/etc/yieldgate:ro", "-v", f"{tmp_path / 'resolv.conf'}:/etc/resolv.conf:ro",
                 "-v", f"{model}:/models/demo:ro", *env, image)
    assert run.returncode == 0, run.stderr
    try:
        url = f"http://127.0.0.1:{PORT}"
        deadline = time.monotonic() + 90
        while True:
            try:
                healthz = httpx.get(url + "/healthz", timeout=2)
                break
            except httpx.TransportError:
                logs = podman("logs", name)
                assert time.monotonic() < deadline, logs.stdout + logs.stderr
                time.sleep(0.5)
        assert healthz.status_code == 200
        assert httpx.get(url + "/readyz", timeout=2).status_code == 503
        pid = int(podman("inspect", "--format", "{{.State.Pid}}", name).stdout)
        assert psutil.Process(pid).uids().real == 10001  # the gateway itself, seen from the host
        logs = podman("logs", name)
        assert "no tokenizer" not in logs.stdout + logs.stderr  # it read the mounted model's tokenizer
    finally:
        podman("rm", "-f", "-t", "2", name)
