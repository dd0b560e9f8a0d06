"""The engine supervisor's policy, on real processes: a small HTTP server stands in for the engine
(so a crash loop costs milliseconds, not a vLLM start each time); the supervisor is stepped with an
explicit clock, so backoff and windows are asserted exactly, without sleeping through them.
The same supervisor restarting a real vLLM engine is tests/test_zy_engine_crash.py."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

from yieldgate.serving.config import FleetConfig, LaunchSpec, ReplicaConfig, SupervisionConfig
from yieldgate.serving.launcher import EngineProcess, Launcher
from yieldgate.serving.supervisor import Supervisor

# An "engine": answers /health (200, or 500 with --sick) on its port and, like vLLM's API server,
# forks a child into its process group that outlives it when only the server is killed.
ENGINE = textwrap.dedent("""
    import http.server, subprocess, sys
    port, mode = int(sys.argv[1]), sys.argv[2]
    if mode == "crash":
        sys.exit(3)
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print("core", core.pid, flush=True)
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(500 if mode == "sick" else 200); self.end_headers()
        def log_message(self, *a): pass
    http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
""")


class ScriptLauncher(Launcher):
    """Launcher whose engines are the script above (mode per start, last one repeats)."""

    def __init__(self, fleet: FleetConfig, log_dir: Path, modes: list[str]) -> None:
        super().__init__(fleet, "", log_dir)
        self.modes = modes
        self.script = log_dir / "engine.py"
        log_dir.mkdir(parents=True, exist_ok=True)
        self.script.write_text(ENGINE)

    def spawn(self, replica: ReplicaConfig) -> EngineProcess:
        mode = self.modes.pop(0) if len(self.modes) > 1 else self.modes[0]
        log_path = self.log_dir / f"{replica.name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([sys.executable, str(self.script), str(replica.launch.port), mode],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return EngineProcess(replica, proc, log_path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_health(url: str, want: int = 200, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == want:
                    return
        except urllib.error.HTTPError as exc:
            if exc.code == want:
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"{url} never answered {want}"
        time.sleep(0.05)


def group_alive(pgid: int) -> bool:
    """Any process of the group still running (zombies excluded: they hold nothing)."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


@pytest.fixture
def make(tmp_path):
    made: list[Launcher] = []

    def build(modes: list[str], **policy) -> tuple[ScriptLauncher, Supervisor, list[tuple[str, str]]]:
        replica = ReplicaConfig(name="e0", launch=LaunchSpec(port=free_port(), startup_timeout_s=30))
        fleet = FleetConfig(replicas=[replica], supervision=SupervisionConfig(**policy))
        launcher = ScriptLauncher(fleet, tmp_path / f"logs{len(made)}", modes)
        launcher.start()
        made.append(launcher)
        events: list[tuple[str, str]] = []
        sup = Supervisor(launcher, fleet.supervision, 2.0, lambda r, e, d: events.append((e, d)))
        return launcher, sup, events

    yield build
    for launcher in made:
        launcher.stop()


def test_a_killed_engine_is_restarted_after_its_whole_group_is_gone(make):
    launcher, sup, events = make(["ok"], backoff_initial_s=1.0)
    first = launcher.engines[0]
    wait_health(first.url)
    w = sup.watched["e0"]
    sup.check(w, now=100.0)
    assert w.state == "running" and events == []

    os.kill(first.process.pid, signal.SIGKILL)  # the server only: its child lives on, as vLLM's core does
    first.process.wait(10)
    assert group_alive(first.process.pid)       # the orphan is really there
    sup.check(w, now=101.0)
    assert w.state == "backoff" and "exited with code -9" in w.reason
    assert not group_alive(first.process.pid)   # the supervisor killed what was left of the group
    assert w.next_start_at == 102.0             # backoff_initial_s * 2**0

    sup.check(w, now=101.5)                     # still in its backoff: nothing started
    assert w.engine is first
    sup.check(w, now=102.0)
    second = launcher.engines[0]
    assert second is w.engine and second.process.pid != first.process.pid and w.state == "starting"
    wait_health(second.url)
    sup.check(w, now=103.0)
    assert w.state == "running" and w.total_restarts == 1
    assert [e for e, _ in events] == ["exited", "restarted", "up"]
    assert sup.status()["e0"]["restarts"] == 1 and sup.status()["e0"]["pid"] == second.process.pid


def test_a_crash_loop_backs_off_doubling_then_stays_down_saying_why(make):
    launcher, sup, events = make(["crash"], backoff_initial_s=1.0, backoff_max_s=4.0, max_restarts=3,
                                 window_s=100.0)
    w = sup.watched["e0"]
    now, delays = 0.0, []
    for _ in range(10):  # bounded: the policy must give up well before this
        w.engine.process.wait(30)
        sup.check(w, now)
        if w.state == "failed":
            break
        assert w.state == "backoff"
        delays.append(w.next_start_at - now)
        now = w.next_start_at
        sup.check(w, now)
        assert w.state == "starting"
    assert delays == [1.0, 2.0, 4.0]             # doubling, capped at backoff_max_s
    assert w.state == "failed" and w.total_restarts == 3
    assert "exited with code 3" in w.reason and "max_restarts 3" in w.reason
    assert events[-1][0] == "gave_up"
    sup.check(w, now + 1000)                    # a failed engine stays down
    assert w.state == "failed" and w.total_restarts == 3


def test_restarts_outside_the_window_do_not_count_toward_giving_up(make):
    launcher, sup, events = make(["crash"], backoff_initial_s=1.0, max_restarts=2, window_s=10.0)
    w = sup.watched["e0"]
    now = 0.0
    for _ in range(4):  # crashes 20 s apart: never two inside one 10 s window
        w.engine.process.wait(30)
        sup.check(w, now)
        assert w.state == "backoff", w.reason
        sup.check(w, w.next_start_at)
        now = w.next_start_at + 20.0
    assert w.total_restarts == 4 and w.state == "starting"


def test_an_engine_that_stops_answering_health_is_restarted(make):
    launcher, sup, events = make(["sick", "ok"], unhealthy_after_s=30.0)
    sick = launcher.engines[0]
    wait_health(sick.url, want=500)
    w = sup.watched["e0"]
    sup.check(w, now=0.0)
    sup.check(w, now=29.0)
    assert w.state == "running" and w.unhealthy_since == 0.0   # not yet: within unhealthy_after_s
    sup.check(w, now=30.0)
    assert w.state == "backoff" and "no health answer for 30 s" in w.reason
    assert sick.process.poll() is not None and not group_alive(sick.process.pid)
    sup.check(w, now=w.next_start_at)
    wait_health(w.engine.url)
    sup.check(w, now=w.next_start_at + 1)
    assert w.state == "running" and [e for e, _ in events] == ["unhealthy", "restarted", "up"]
