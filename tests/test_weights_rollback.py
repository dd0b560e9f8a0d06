"""Rollback returns each replica to what it served before, through a gateway, against the session
stack's two real engines, under load throughout.

A gateway process of its own (its own YIELDGATE_HOME: checkpoint store, history, push token) over
the stack's engines, restarted twice in the story to show the history lives with the store:

    base -> A -> rollback -> base        (A is marked rolled back)
    [gateway restarted]
    -> B -> rollback -> base             (not A)
    {"to": "A"} -> A, and says A had been marked; {"to": "base"} -> base
    -> C -> D -> E (its canary fails: D keeps serving; E is marked failed)
    [gateway restarted]
    rollback -> C                        (not E, not D)

Load threads ask both tiers for a greedy completion the whole time (paused only while the
gateway process is down): no request fails, and every response's text is the text of the
weights its `x-yieldgate-weight-version` names. The engines end on their launch weights, armed
with the stack gateway's push token again.
"""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from yieldgate.gateway.config import Config, ServerConfig
from yieldgate.gateway.embedded import GatewayProcess
from yieldgate.serving.config import FleetConfig, ReplicaConfig
from yieldgate.trainer_bridge import arm_engine, push, write_checkpoint

pytestmark = pytest.mark.engine

ADMIN = "rollback-admin-" + uuid.uuid4().hex[:8]
PROMPT = "Once upon a time"
MODELS = ("demo", "demo:fast")
REPLICAS = {"standard": "standard-0", "fast": "fast-0"}


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


class Gateway:
    """The gateway process under test; `restart()` stops it and starts it again over the same home."""

    def __init__(self, config: Config, workdir: Path) -> None:
        self.config, self.workdir = config, workdir
        self.proc = GatewayProcess(config, workdir)

    @property
    def url(self) -> str:
        return self.proc.url

    def restart(self) -> None:
        self.proc.stop()
        self.proc = GatewayProcess(self.config, self.workdir)

    def admin(self, method: str, path: str, **kw) -> httpx.Response:
        return httpx.request(method, self.url + path, timeout=300,
                             headers={"Authorization": f"Bearer {ADMIN}"}, **kw)

    def weights(self) -> dict:
        return self.admin("GET", "/admin/weights").json()

    def serving(self) -> dict[str, str]:
        return {n: r["weight_version"] for n, r in self.weights()["replicas"].items()}

    def rollback(self, **body) -> dict:
        resp = self.admin("POST", "/admin/weights/rollback", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()


class Load:
    """Threads that keep asking each tier for the same greedy completion; every answer or
    exception is recorded as (model, status, version label, text). Status 0 = an exception."""

    def __init__(self, gateway: Gateway, threads_per_model: int = 1) -> None:
        self.gateway = gateway
        self.seen: list[tuple[str, int, str, str]] = []
        self.stop = threading.Event()
        self.running = threading.Event()  # cleared while the gateway is down
        self.idle = [threading.Event() for _ in range(threads_per_model * len(MODELS))]
        self.threads = [threading.Thread(target=self._run, args=(m, self.idle[i]))
                        for i, m in enumerate(MODELS * threads_per_model)]

    def _run(self, model: str, idle: threading.Event) -> None:
        with httpx.Client(timeout=120) as http:
            while not self.stop.is_set():
                if not self.running.is_set():
                    idle.set()
                    self.running.wait(1)
                    continue
                idle.clear()
                try:
                    r = http.post(self.gateway.url + "/v1/completions", json={
                        "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
                    ok = r.status_code == 200
                    text = r.json()["choices"][0]["text"] if ok else r.text[:200]
                    self.seen.append((model, r.status_code, r.headers.get("x-yieldgate-weight-version", ""), text))
                except Exception as exc:  # noqa: BLE001 - any exception is a failed request
                    self.seen.append((model, 0, "", f"{type(exc).__name__}: {exc}"))

    def start(self) -> None:
        self.running.set()
        for t in self.threads:
            t.start()

    def pause(self) -> None:
        self.running.clear()
        for idle in self.idle:
            assert idle.wait(180), "a load thread did not finish its request"

    def resume(self) -> None:
        self.running.set()

    def close(self) -> None:
        self.stop.set()
        self.running.set()
        for t in self.threads:
            t.join(180)

    def failures(self) -> list:
        return [s for s in self.seen if s[1] != 200]


@pytest.fixture(scope="module")
def rig(stack, redis_url, tmp_path_factory):
    """-> (Gateway, Load) over the stack's engines; hands the engines back on base weights and
    the stack gateway's push token."""
    home = tmp_path_factory.mktemp("rollback-home")
    stack_admin = {"Authorization": f"Bearer {stack.admin_token}"}
    resp = httpx.get(stack.gateway_url + "/admin/weight_targets", params={"direct": 1},
                     headers=stack_admin, timeout=120)
    assert resp.status_code == 200, resp.text
    stack_token = resp.json()["push_token"]
    assert set(httpx.get(stack.gateway_url + "/admin/weights", headers=stack_admin, timeout=60)
               .json()["replicas"][r]["weight_version"] for r in REPLICAS.values()) == {"base"}
    # This gateway takes over the engines with the push token they hold.
    token_file = home / "weights" / "engine_push_token"
    token_file.parent.mkdir(parents=True)
    token_file.touch(mode=0o600)
    token_file.write_text(stack_token)

    config = Config(
        server=ServerConfig(admin_token=ADMIN, redis_url=redis_url, data_dir=str(home / "data")),
        fleet=FleetConfig(model=stack.model, model_path=str(stack.model_dir), health_interval_s=0.5,
                          replicas=[ReplicaConfig(name=name, tier=tier, url=stack.engines[tier])
                                    for tier, name in REPLICAS.items()]))
    config.pricing.ledger.journal_dir = str(home / "ledger")
    config.pricing.ledger.redis_url = config.pricing.limits.redis_url = redis_url
    config.pricing.ledger.redis_prefix = f"ygrollback-{uuid.uuid4().hex[:8]}:"
    env = pytest.MonkeyPatch()
    env.setenv("YIELDGATE_HOME", str(home))  # the gateway process inherits it
    gateway = None
    load = None
    try:
        gateway = Gateway(config, home / "gateways")
        load = Load(gateway)
        yield gateway, load
    finally:
        if load is not None:
            load.close()
        if gateway is not None:
            if set(gateway.serving().values()) != {"base"}:
                gateway.admin("POST", "/admin/weights/rollback", json={"to": "base"})
            gateway.proc.stop()
        env.undo()
        current = token_file.read_text().strip()
        if current != stack_token:
            for url in stack.engines.values():
                arm_engine(url, stack_token, current_token=current)


def texts(gateway: Gateway) -> tuple[str, dict[str, str]]:
    """-> (the version every replica serves, {model: its greedy text}), asked through the gateway."""
    out, labels = {}, set()
    for model in MODELS:
        r = httpx.post(gateway.url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        labels.add(r.headers["x-yieldgate-weight-version"])
        out[model] = r.json()["choices"][0]["text"]
    assert len(labels) == 1, labels
    return labels.pop(), out


def test_rollback_returns_to_what_served_before_across_restarts(stack, rig, tmp_path):
    gateway, load = rig
    base_weights = load_file(str(Path(stack.model_dir) / "model.safetensors"))
    expected: dict[str, dict[str, str]] = {}  # version -> {model: greedy text}
    steps: list[tuple[str, int]] = []  # (step, responses seen when it ended)

    def settled(version: str, step: str) -> None:
        """Every replica serves `version`; remember its text, and that load was answered."""
        assert set(gateway.serving().values()) == {version}, (step, gateway.serving())
        label, out = texts(gateway)
        assert label == version
        if version in expected:
            assert out == expected[version], (step, version)  # the same weights answer the same
        else:
            assert out not in expected.values(), f"{version} answers like an earlier version"
            expected[version] = out
        answered = sum(1 for s in load.seen if s[1] == 200)
        assert answered > (steps[-1][1] if steps else 0), f"no request answered during {step}"
        steps.append((step, answered))

    def pushed(version: str, seed: int) -> None:
        report = push(perturbed(base_weights, seed), version, gateway=gateway.url, token=ADMIN, progress=False)
        assert report.version == version
        settled(version, f"push {version}")

    def rolled_back(version: str, step: str, **body) -> dict:
        answer = gateway.rollback(**body)
        assert answer["rollout"]["state"] == "succeeded"
        assert answer["targets"] == {name: version for name in REPLICAS.values()}, answer
        settled(version, step)
        return answer

    def restarted() -> None:
        """Stop and start the gateway; it must give the same answers about the past."""
        before = gateway.weights()
        load.pause()
        gateway.restart()
        load.resume()
        after = gateway.weights()
        for key in ("versions", "weight_history", "rollback_to"):
            assert after[key] == before[key], key
        assert gateway.serving() == {n: r["weight_version"] for n, r in before["replicas"].items()}

    assert set(gateway.serving().values()) == {"base"}
    load.start()
    settled("base", "start")

    # base -> A -> rollback -> base.
    pushed("A", 11)
    assert gateway.weights()["rollback_to"] == {name: "base" for name in REPLICAS.values()}
    answer = rolled_back("base", "rollback from A")
    assert answer["chosen_by"] == "history"
    marks = {v["version"]: v["mark"] for v in gateway.weights()["weight_history"]}
    assert marks["A"]["mark"] == "rolled_back"
    # Nothing is left to roll back to: A was rolled back, base is served.
    assert gateway.weights()["rollback_to"] == {name: None for name in REPLICAS.values()}

    restarted()

    # -> B -> rollback -> base, not A.
    pushed("B", 12)
    assert gateway.weights()["rollback_to"] == {name: "base" for name in REPLICAS.values()}
    rolled_back("base", "rollback from B")

    # A, rolled back before, can still be named on purpose; the answer says it had been marked.
    answer = rolled_back("A", "explicit rollback to A", to="A")
    assert answer["chosen_by"] == "request"
    assert "A had been marked rolled_back" in answer["notice"], answer
    rolled_back("base", "explicit rollback to base", to="base")

    # -> C -> D -> E, whose canary fails on its first replica: D keeps serving everywhere.
    pushed("C", 13)
    pushed("D", 14)
    ckpt = write_checkpoint(perturbed(base_weights, 15), stack.model_dir, tmp_path / "E")
    resp = gateway.admin("POST", "/admin/weights", json={
        "version": "E", "source": {"checkpoint": str(ckpt)}, "mode": "rolling", "wait": True,
        "canary": {"prompt": PROMPT, "expect_substring": "no model says this \u2603"}})
    assert resp.status_code == 200, resp.text
    state = resp.json()["rollout"]
    assert state["state"] == "failed" and "evaluation" in state["reason"], state
    settled("D", "failed rollout of E")
    status = gateway.weights()
    e = next(v for v in status["weight_history"] if v["version"] == "E")
    assert e["mark"]["mark"] == "failed" and "evaluation" in e["mark"]["reason"], e
    assert status["rollback_to"] == {name: "C" for name in REPLICAS.values()}

    restarted()

    # The rollback after the failed E returns to C: D is left (rolled back), E is skipped.
    rolled_back("C", "rollback after E failed")
    status = gateway.weights()
    history = {v["version"]: v for v in status["weight_history"]}
    assert history["D"]["mark"]["mark"] == "rolled_back"
    assert history["C"]["mark"] is None
    ended = {s["ended"] for s in history["D"]["served"] if s["ended_at"] is not None}
    assert "rolled_back" in ended, history["D"]
    # What a rollback would return to now is still held (base: the launch weights themselves).
    assert status["rollback_to"] == {name: "base" for name in REPLICAS.values()}
    assert history["base"]["stored"] and history["C"]["stored"], status["versions"]

    rolled_back("base", "back to the launch weights", to="base")
    load.close()

    assert load.seen, "no load was sent"
    assert not load.failures(), load.failures()[:5]
    labels = {label for _, _, label, _ in load.seen}
    assert "E" not in labels  # E never served a request
    assert labels <= set(expected), labels - set(expected)
    # The label is the truth: every response is the text of the weights it names.
    wrong = [s for s in load.seen if s[3] != expected[s[2]][s[0]]]
    assert not wrong, wrong[:5]
    # Responses came from every version that served, on both tiers.
    assert {(m, v) for m, _, v, _ in load.seen} >= {(m, v) for m in MODELS for v in ("base", "C", "D")}
    print(f"\n[rollback] {len(load.seen)} requests over {len(steps)} steps; "
          f"per version: { {v: sum(1 for s in load.seen if s[2] == v) for v in expected} }")
