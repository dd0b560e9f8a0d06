"""An all_at_once rollout holds new requests while every replica swaps; a request held longer
than `limits.weight_swap_hold_s` gets an OpenAI-shaped 503 saying why, instead of hanging.

Starts one engine of its own (the `yieldgate` backend, one sequence at a time) behind an
in-process gateway whose hold is set short. A streamed request of 64,000 decode steps holds up the
drain, so the swap outlasts the hold however fast this machine is; closing it lets the rollout
finish.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from engines import start_engine, stop_engine, wait_healthy
from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import EmbeddedGateway
from yieldgate.serving.config import FleetConfig, ReplicaConfig
from yieldgate.trainer_bridge import push

pytestmark = pytest.mark.engine

PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 302
ADMIN = "hold-admin-" + os.urandom(4).hex()
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def held_fleet(tmp_path_factory, redis_url):
    """-> (gateway URL, engine URL, model dir): one engine, a gateway holding requests for 1 s."""
    from yieldgate.serving.demo_model import ensure_demo_model

    model_dir = ensure_demo_model()
    home = tmp_path_factory.mktemp("hold-home")
    # One sequence at a time: the test's 16-choice request below keeps it busy for minutes.
    proc = start_engine(model_dir, PORT, home / "engine.log", "--max-model-len", "4096",
                        "--max-num-seqs", "1")
    url = f"http://127.0.0.1:{PORT}"
    gateway = None
    try:
        wait_healthy(url, proc, home / "engine.log")
        with pytest.MonkeyPatch.context() as env:
            env.setenv("YIELDGATE_HOME", str(home))  # checkpoints, push token and ledger stay here
            config = Config(
                server=ServerConfig(admin_token=ADMIN, redis_url=redis_url),
                fleet=FleetConfig(model="demo", model_path=str(model_dir), health_interval_s=0.5,
                                  replicas=[ReplicaConfig(name="hold-0", tier="standard", url=url)]))
            config.limits.weight_swap_hold_s = 1.0
            gateway = EmbeddedGateway(config)
            yield gateway.url, url, Path(model_dir)
    finally:
        if gateway is not None:
            gateway.stop()
        stop_engine(proc)


def rollout_state(gateway: str) -> dict:
    return httpx.get(gateway + "/admin/weights", headers={"Authorization": f"Bearer {ADMIN}"},
                     timeout=60).json()["rollout"] or {}


def test_a_request_held_past_the_hold_gets_a_503_and_the_swap_still_lands(held_fleet):
    gateway, _engine, model_dir = held_fleet
    base = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(11)
    new_weights = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}
    outcome: dict = {}

    def push_all_at_once() -> None:
        try:
            outcome["report"] = push(new_weights, "held-1", gateway=gateway, token=ADMIN,
                                     progress=False, mode="all_at_once")
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome["error"] = exc

    # Arm the engine and learn its dtype first (the first /server_info of an engine takes
    # seconds), so the push reaches its hold while the long request below still runs.
    warm = httpx.get(gateway + "/admin/weight_targets", params={"mode": "all_at_once"},
                     headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    assert warm.status_code == 200, warm.text
    pusher = threading.Thread(target=push_all_at_once)
    with httpx.Client(timeout=120) as http:
        # 16 x 4000 tokens decoded one sequence at a time: 64,000 engine steps. It ends when the
        # test closes it.
        with http.stream("POST", gateway + "/v1/completions", json={
                "model": "demo", "prompt": PROMPT, "max_tokens": 4000, "n": 16, "ignore_eos": True,
                "stream": True}) as long:
            assert long.status_code == 200
            lines = long.iter_lines()  # kept: a dropped iterator would close the connection
            for line in lines:
                if line.startswith("data: "):
                    break  # in flight on the only replica: the swap's drain waits for it
            pusher.start()
            deadline = time.monotonic() + 120
            while "hold" not in [e["event"] for e in rollout_state(gateway).get("timeline", [])]:
                assert pusher.is_alive() and time.monotonic() < deadline, outcome
                time.sleep(0.05)

            held = http.post(gateway + "/v1/completions", json={
                "model": "demo", "prompt": PROMPT, "max_tokens": 4})
            assert held.status_code == 503, held.text
            error = held.json()["error"]
            assert error["type"] == "service_unavailable"
            assert error["code"] == "weight_swap_in_progress"
            assert "swapping to new weights" in error["message"]
            assert held.headers["retry-after"] == "1"
        # Closing the long stream aborts it on the engine: the drain ends, the swap goes on.
    pusher.join(300)
    assert "report" in outcome, outcome
    state = rollout_state(gateway)
    assert state["state"] == "succeeded" and state["mode"] == "all_at_once", state.get("reason")
    after = httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": "demo", "prompt": PROMPT, "max_tokens": 4})
    assert after.status_code == 200
    assert after.headers["x-yieldgate-weight-version"] == "held-1"
