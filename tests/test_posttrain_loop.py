"""The post-training loop's gate on the real model (one SmolLM2 engine with LoRA, one gateway):
the sabotage drill — a broken adapter pushed as a canary is rolled back by the gateway's own
timer within one evaluation window, having had no more than its canary share of the traffic
(counted in the ledger) — and the loop's state surviving a trainer restart.

YIELDGATE_TEST_SMOLLM2_LORA_URL reuses an engine started with the same flags (dev loop).
"""

from __future__ import annotations

import math
import os
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from safetensors.torch import load_file

from engines import running_engine
from yieldgate.serving import smollm2
from yieldgate.pricing.release_gate import CanaryGateConfig, OutcomeRule
from yieldgate.serving.peft import random_adapter
from yieldgate.serving.smollm2 import ensure_smollm2
from yieldgate.trainer_bridge import push_adapter
from yieldgate.trainer_bridge.posttrain import LoopState, PosttrainLoop, PosttrainSettings, RoundRow
from yieldgate.trainer_bridge.tasks import check, task_split

PORT_BASE = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000"))
ENGINE_HOST, ENGINE_PORT = "127.0.2.4", PORT_BASE + 170
ADMIN = "pt-admin-" + secrets.token_hex(6)
MODEL = "smollm2-posttrain"   # a registry of its own in Redis (adapters are keyed by the model name)
EVALUATE_S = 3.0
SHARE = 0.5
# The launcher's polling (serving/engine_polling.py) and one OpenMP thread: on a shared host two
# threads of the engine's worker wait for each other at every barrier.
POLLING = {"YIELDGATE_ENGINE_POLL_PAUSE_US": "50", "YIELDGATE_ENGINE_POLL_SPIN_US": "300", "OMP_NUM_THREADS": "1"}
RULE = OutcomeRule(confidence=0.999, min_graded=10, max_graded=200)


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    return ensure_smollm2()


@pytest.fixture(scope="module")
def lora_engine(smol_dir: Path, tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("posttrain-engine") / "engine.log"
    with running_engine(smol_dir, ENGINE_PORT, log, "--enable-prefix-caching", "--max-model-len", "2048", *smollm2.SERVE_ARGS,
                        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2", host=ENGINE_HOST, served_name=MODEL,
                        reuse_env="YIELDGATE_TEST_SMOLLM2_LORA_URL", env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **POLLING}) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(lora_engine: str, smol_dir: Path, redis_url: str, tmp_path_factory):
    from conftest import InProcessGateway
    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.serving.config import FleetConfig, ReplicaConfig

    home = tmp_path_factory.mktemp("posttrain-gateway")
    env = pytest.MonkeyPatch()
    env.setenv("YIELDGATE_HOME", str(home))  # pushed adapters and the ledger: this module's own
    config = Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(home / "data")),
        fleet=FleetConfig(model=MODEL, model_path=str(smol_dir), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name="smol-0", tier="standard", url=lora_engine)]),
        canary=CanaryGateConfig(evaluate_s=EVALUATE_S, rule=RULE))
    gw = InProcessGateway(config)
    try:
        yield gw
    finally:
        with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {ADMIN}"}) as admin:
            for a in admin.get("/admin/adapters").json()["data"]:
                admin.delete(f"/admin/adapters/{a['name']}")
        gw.stop()
        env.undo()


def decidable_at(sent: list[tuple[str, bool, float]], name: str, enough_at: float) -> float:
    """When the grades in time order first put the canary's success rate below the stable one's
    beyond noise (pricing/release_gate.py's bound at the rule's confidence); `enough_at` if never."""
    from statistics import NormalDist

    from yieldgate.pricing.release_gate import rate_difference_bounds

    z = NormalDist().inv_cdf(RULE.confidence)
    counts = {f"{name}@v0": [0, 0], f"{name}@broken": [0, 0]}
    for version, passed, at in sorted(sent, key=lambda x: x[2]):
        counts[version][0] += passed
        counts[version][1] += 1
        (ss, sn), (cs, cn) = counts[f"{name}@v0"], counts[f"{name}@broken"]
        if min(sn, cn) >= RULE.min_graded and rate_difference_bounds((cs, cn), (ss, sn), z)[1] < 0:
            return max(at, enough_at)
    return enough_at


def adapters(smol_dir: Path, root: Path) -> tuple[dict, dict]:
    """-> (a zero adapter: the base model's answers; a broken one: large random LoRA weights)."""
    tensors = load_file(random_adapter(smol_dir, root / "zero", seed=1) / "adapter_model.safetensors")
    zero = {k: torch.zeros_like(v) if ".lora_B." in k else v for k, v in tensors.items()}
    broken = load_file(random_adapter(smol_dir, root / "broken", seed=2, scale=4.0) / "adapter_model.safetensors")
    return zero, broken


@pytest.mark.engine
def test_sabotage_drill_a_broken_canary_is_rolled_back_by_the_gateways_timer(gateway, smol_dir, tmp_path):
    name = "pt-sabotage"
    admin = httpx.Client(base_url=gateway.url, timeout=120, headers={"Authorization": f"Bearer {ADMIN}"})
    client = OpenAI(base_url=gateway.url + "/v1", api_key="none", max_retries=0, timeout=300)
    zero, broken = adapters(smol_dir, tmp_path)
    push_adapter(zero, name=name, version="v0", gateway=gateway.url, token=ADMIN)
    report = push_adapter(broken, name=name, version="broken", gateway=gateway.url, token=ADMIN, canary=SHARE)
    assert report.adapter["canary"]["version"] == "broken"
    started = report.adapter["canary"]["started"]
    tasks = task_split("capitals", "train", 200, exact=False)

    def graded(i: int) -> tuple[str, bool, float]:
        task = tasks[i % len(tasks)]
        raw = client.chat.completions.with_raw_response.create(
            model=name, messages=[{"role": "user", "content": task.prompt}], max_tokens=task.max_tokens, temperature=0.7)
        passed = check(task, raw.parse().choices[0].message.content or "")
        r = httpx.post(gateway.url + "/v1/feedback", json={"request_id": raw.headers["x-request-id"], "passed": passed})
        assert r.status_code == 200, r.text
        return raw.headers["x-yieldgate-weight-version"], passed, time.time()

    sent: list[tuple[str, bool, float]] = []
    enough_at = None            # when both versions first had the rule's min_graded grades
    with ThreadPoolExecutor(4) as pool:
        while len(sent) < 160:
            sent += pool.map(graded, range(len(sent), len(sent) + 4))
            counts = {v: sum(1 for x in sent if x[0] == v) for v in (f"{name}@v0", f"{name}@broken")}
            if enough_at is None and min(counts.values()) >= RULE.min_graded:
                enough_at = max(x[2] for x in sent)
            doc = next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == name)
            if doc["canary"] is None:
                break
    decisions = admin.get(f"/admin/adapters/{name}/canary/decisions").json()["data"]
    stable = [p for v, p, _ in sent if v.endswith("@v0")]
    on_canary = [p for v, p, _ in sent if v.endswith("@broken")]
    print(f"\n[sabotage drill] {len(sent)} requests: v0 passed {sum(stable)}/{len(stable)}, broken canary "
          f"{sum(on_canary)}/{len(on_canary)}; decision {decisions[-1]['verdict'] if decisions else None} "
          f"{(decisions[-1]['at'] - enough_at) if decisions and enough_at else float('nan'):.1f} s after the "
          f"rule's minimum was graded: {decisions[-1]['reason'] if decisions else ''}")
    assert doc["canary"] is None and doc["current"] == "v0", doc
    assert len(decisions) == 1 and decisions[0]["verdict"] == "rollback" and decisions[0]["by"] == "timer"
    # Within one evaluation window of the grades that decide it (plus the ledger flush and a tick):
    # from when the graded requests first said "worse beyond noise" by the rule's own bound (how many
    # that takes depends on the base model's success rate), or from min_graded if the cost rule came first.
    assert decisions[0]["at"] - decidable_at(sent, name, enough_at) <= EVALUATE_S + 5.0
    # The ledger: the broken version served no more than its share of the adapter's requests.
    spend = admin.get("/admin/spend", params={"group_by": "weight_version", "since": started}).json()
    by_version = {r["group"]["weight_version"]: r["requests"] for r in spend["rows"]}
    total = by_version.get(f"{name}@v0", 0) + by_version.get(f"{name}@broken", 0)
    assert total == len(sent)
    assert by_version[f"{name}@broken"] <= math.ceil(SHARE * total), by_version
    after = [graded(i)[0] for i in range(4)]
    assert after == [f"{name}@v0"] * 4


def test_the_loop_resumes_at_the_next_round(tmp_path, monkeypatch):
    """A restarted trainer reads the state file and continues where it stopped (no engine)."""
    settings = PosttrainSettings(gateway="http://127.0.0.1:9", admin_token="x", model_dir=str(tmp_path),
                                 adapter="resume", rounds=3, state_path=str(tmp_path / "state.json"))
    row = dict(decision="promote", reason="", serving="r1", eval_success=0.5, eval_solved=1, eval_tasks=2,
               usd_per_solved=0.1, train_examples=3, train_cpu_s=1.0, grading_requests=4, grading_tokens=5,
               grading_usd=0.01, round_usd=0.02, seconds=6.0)
    loop = PosttrainLoop(settings)
    loop.state = LoopState("resume", [RoundRow(round=0, version="v0", **row), RoundRow(round=1, version="r1", **row)],
                           [["What is 1 + 1?", "2"]])
    loop.save()
    again = PosttrainLoop(settings)
    assert again.state == loop.state
    ran: list[int] = []
    monkeypatch.setattr(again, "round_zero", lambda: pytest.fail("round 0 ran again"))
    monkeypatch.setattr(again, "round", lambda n: (ran.append(n), again.state.rounds.append(
        RoundRow(round=n, version=f"r{n}", **row))))
    assert [r.round for r in again.run()] == [0, 1, 2, 3] and ran == [2, 3]
    with pytest.raises(ValueError, match="adapter 'resume'"):
        PosttrainLoop(msgspec_replace(settings, adapter="other"))


def msgspec_replace(settings: PosttrainSettings, **changes) -> PosttrainSettings:
    import msgspec

    return msgspec.structs.replace(settings, **changes)
