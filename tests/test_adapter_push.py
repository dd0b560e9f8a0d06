"""Adapters pushed from a trainer (`trainer_bridge.push_adapter`) into the session stack (both
engines run with LoRA on): one checksummed upload serves on every replica; a corrupt upload is
refused in OpenAI's error shape and the current version keeps serving; the post-training example
changes the adapter's answer and not the base model's; a canary version gets its share of
traffic and is promoted or rolled back by the outcome rule over /v1/feedback.

The tests share one story (adapter `tp-a`) and delete their adapters at the end.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib.util
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save

from yieldgate.serving.peft import pack_adapter, random_adapter
from yieldgate.trainer_bridge import AdapterPushRefused, push_adapter

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parent.parent
NAME = "tp-a"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def admin(stack) -> httpx.Client:
    with stack.admin_client() as client:
        yield client
        for adapter in client.get("/admin/adapters").json()["data"]:
            client.delete(f"/admin/adapters/{adapter['name']}")


@pytest.fixture(scope="module")
def weights(stack, tmp_path_factory) -> dict[int, dict[str, torch.Tensor]]:
    """Seeded random rank-8 adapters of the demo model, as state dicts a trainer holds."""
    root = tmp_path_factory.mktemp("pushed")
    return {seed: load_file(random_adapter(Path(stack.model_dir), root / f"s{seed}", seed=seed)
                            / "adapter_model.safetensors") for seed in (11, 12, 13)}


@pytest.fixture(scope="module")
def story() -> dict:
    return {}


def complete(gateway: str, model: str) -> httpx.Response:
    return httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})


def status(admin: httpx.Client, name: str) -> dict:
    return next(a for a in admin.get("/admin/adapters").json()["data"] if a["name"] == name)


def wait_unloaded(admin: httpx.Client, name: str, version: str, timeout_s: float = 60) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        doc = status(admin, name)
        if not any(version in held for held in doc["replicas"].values()):
            return doc
        assert time.monotonic() < deadline, doc
        time.sleep(0.2)


def test_a_pushed_state_dict_serves_under_its_name_on_every_replica(stack, admin, weights, story):
    story["base"] = complete(stack.gateway_url, "demo").json()["choices"][0]["text"]
    with pytest.raises(AdapterPushRefused) as refused:  # the admin credential is required
        push_adapter(weights[11], name=NAME, version="v1", gateway=stack.gateway_url, token="wrong")
    assert refused.value.status == 401
    report = push_adapter(weights[11], name=NAME, version="v1", gateway=stack.gateway_url, token=stack.admin_token)
    assert report.adapter["current"] == "v1"
    assert report.adapter["replicas"] == {"fast-0": {"v1": "resident"}, "standard-0": {"v1": "resident"}}
    # Stored by the gateway as a PEFT directory, named by its content's checksum.
    path = Path(report.adapter["versions"][0]["path"])
    assert path.name == f"sha256-{report.sha256[:32]}"
    assert {p.name for p in path.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    for model in (NAME, NAME + ":fast"):
        r = complete(stack.gateway_url, model)
        assert r.status_code == 200, r.text
        assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v1"
        story["v1"] = r.json()["choices"][0]["text"]
        assert story["v1"] != story["base"]


def _refused(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code and error["message"]
    assert error["type"] == "invalid_request_error"


def test_a_corrupt_push_is_refused_with_a_clear_4xx_and_the_current_version_keeps_serving(stack, admin, weights, story):
    good = pack_adapter(weights[12], rank=8, alpha=8.0)
    url = f"/admin/adapters/{NAME}/versions/v2"

    def put(body: bytes, digest: str | None = None) -> httpx.Response:
        headers = {"x-yieldgate-sha256": hashlib.sha256(body).hexdigest() if digest is None else digest}
        return admin.put(url, content=body, headers=headers)

    # Damaged in transit: one byte flipped after the checksum was taken.
    damaged = bytearray(good)
    damaged[len(damaged) // 2] ^= 0xFF
    _refused(put(bytes(damaged), hashlib.sha256(good).hexdigest()), 400, "checksum_mismatch")
    _refused(put(good, ""), 400, "missing_checksum")
    # Not an adapter: not safetensors; safetensors without a PEFT config; a key that is no LoRA's.
    _refused(put(b"\x00\x01 not a safetensors file" * 100), 400, "invalid_adapter")
    _refused(put(save(weights[12])), 400, "invalid_adapter")
    extra = dict(weights[12], **{"lm_head.weight": torch.zeros(4, 4)})
    _refused(put(pack_adapter(extra, rank=8, alpha=8.0)), 400, "invalid_adapter")
    # Well formed but not for this fleet: rank above --max-lora-rank, a shape the model does not have.
    wide = {k: torch.cat([v, v], dim=0 if ".lora_A." in k else 1) for k, v in weights[12].items()}
    with pytest.raises(AdapterPushRefused) as refused:
        push_adapter(wide, name=NAME, version="v2", gateway=stack.gateway_url, token=stack.admin_token)
    assert (refused.value.status, refused.value.code) == (422, "incompatible_adapter")
    assert "max-lora-rank" in refused.value.message
    key = next(k for k in weights[12] if k.endswith("q_proj.lora_A.weight"))
    _refused(put(pack_adapter(dict(weights[12], **{key: torch.zeros(8, 64)}), rank=8, alpha=8.0)),
             422, "incompatible_adapter")
    doc = status(admin, NAME)
    assert doc["current"] == "v1" and [v["version"] for v in doc["versions"]] == ["v1"]
    assert doc["replicas"] == {"fast-0": {"v1": "resident"}, "standard-0": {"v1": "resident"}}
    for model in (NAME, NAME + ":fast"):
        r = complete(stack.gateway_url, model)
        assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v1"
        assert r.json()["choices"][0]["text"] == story["v1"]


def test_the_post_training_example_changes_the_adapter_and_not_the_base(stack, admin):
    spec = importlib.util.spec_from_file_location("posttrain_lora_demo", ROOT / "examples" / "posttrain_lora_demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    out = demo.run(stack.gateway_url, stack.admin_token, "tp-demo", "sft-1", Path(stack.model_dir), log=print)
    # Trained in float32 with a lead of 1.5 logits per answer token; the engine computes in its own
    # precision, so the answer is held to "toward the target", the base model to "unchanged".
    toward = difflib.SequenceMatcher(None, out["adapter"], demo.ANSWER).ratio()
    assert toward >= 0.8, out
    assert out["base_after"] == out["base_before"]
    assert difflib.SequenceMatcher(None, out["base_after"], demo.ANSWER).ratio() < toward
    assert admin.delete("/admin/adapters/tp-demo").status_code == 200


def _canary_round(stack, version: str, graded: dict[str, bool], n: int = 16) -> dict[str, str]:
    """`n` requests for the adapter; each graded through /v1/feedback as `graded` says for the
    version that answered it. -> version label -> the one greedy text it gave."""
    texts: dict[str, set[str]] = {}
    for _ in range(n):
        r = complete(stack.gateway_url, NAME)
        assert r.status_code == 200, r.text
        label = r.headers["x-yieldgate-weight-version"]
        texts.setdefault(label, set()).add(r.json()["choices"][0]["text"])
        fb = httpx.post(stack.gateway_url + "/v1/feedback", timeout=30, json={
            "request_id": r.headers["x-request-id"], "passed": graded[label.rsplit("@", 1)[1]]})
        assert fb.status_code == 200, fb.text
    assert {k: len(v) for k, v in texts.items()} == {f"{NAME}@v1": 1, f"{NAME}@{version}": 1}
    return {k: v.pop() for k, v in texts.items()}


def test_a_canary_gets_its_share_and_the_outcome_rule_promotes_it(stack, admin, weights, story):
    report = push_adapter(weights[12], name=NAME, version="v2", gateway=stack.gateway_url,
                          token=stack.admin_token, canary=0.25)
    assert report.adapter["current"] == "v1" and report.adapter["canary"]["version"] == "v2"
    assert admin.put(f"/admin/adapters/{NAME}/versions/v3", content=b"x",
                     headers={"x-yieldgate-sha256": "0" * 64}).status_code == 400
    evaluate = f"/admin/adapters/{NAME}/canary/evaluate"
    texts = _canary_round(stack, "v2", {"v1": False, "v2": True})
    assert texts[f"{NAME}@v1"] == story["v1"] and texts[f"{NAME}@v2"] != story["v1"]
    doc = status(admin, NAME)["canary"]
    assert (doc["requests"], doc["sent"]) == (16, 4)  # exactly its share
    story["v2"] = texts[f"{NAME}@v2"]
    r = admin.post(evaluate, json={})  # the default rule wants 20 graded tasks per version
    assert r.status_code == 200 and r.json()["verdict"] == "wait", r.text
    r = admin.post(evaluate, json={"min_graded": 4})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["verdict"] == "promote", body
    assert body["versions"][f"{NAME}@v2"]["success_rate"] == 1.0
    assert body["versions"][f"{NAME}@v1"]["success_rate"] == 0.0
    assert body["adapter"]["current"] == "v2" and body["adapter"]["canary"] is None
    assert body["adapter"]["history"] == ["v1", "v2"]
    assert admin.post(evaluate, json={}).status_code == 409
    wait_unloaded(admin, NAME, "v1")
    r = complete(stack.gateway_url, NAME)
    assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v2" and r.json()["choices"][0]["text"] == story["v2"]


def test_a_canary_that_does_worse_is_rolled_back_and_the_current_version_keeps_serving(stack, admin, weights, story):
    push_adapter(weights[13], name=NAME, version="v3", gateway=stack.gateway_url, token=stack.admin_token, canary=0.5)
    # Only this round's requests count: the canary's clock started at its push.
    texts: dict[str, str] = {}
    for _ in range(8):
        r = complete(stack.gateway_url, NAME)
        label = r.headers["x-yieldgate-weight-version"]
        texts[label] = r.json()["choices"][0]["text"]
        httpx.post(stack.gateway_url + "/v1/feedback", timeout=30,
                   json={"request_id": r.headers["x-request-id"], "passed": label.endswith("@v2")})
    assert set(texts) == {f"{NAME}@v2", f"{NAME}@v3"} and texts[f"{NAME}@v2"] == story["v2"]
    r = admin.post(f"/admin/adapters/{NAME}/canary/evaluate", json={"min_graded": 4})
    assert r.status_code == 200 and r.json()["verdict"] == "rollback", r.text
    doc = wait_unloaded(admin, NAME, "v3")
    assert doc["current"] == "v2" and doc["canary"] is None and doc["history"] == ["v1", "v2"]
    assert doc["replicas"] == {"fast-0": {"v2": "resident"}, "standard-0": {"v2": "resident"}}
    for _ in range(4):
        r = complete(stack.gateway_url, NAME)
        assert r.headers["x-yieldgate-weight-version"] == f"{NAME}@v2"
    # Rollback then steps back to N-1, as for a version pushed without a canary.
    r = admin.post(f"/admin/adapters/{NAME}/rollback")
    assert r.status_code == 200 and r.json()["current"] == "v1", r.text
    assert complete(stack.gateway_url, NAME).json()["choices"][0]["text"] == story["v1"]
