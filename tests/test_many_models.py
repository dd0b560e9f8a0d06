"""Two models behind one gateway, on real engines, through the official openai client: the session
stack's engines serve `demo` (standard and fast), an engine of this module's own serves `tiny-b`
(the same tiny weights under another name: enough to tell which engine answered), and a third model
has no engine that answers, so its requests fall back to `demo`. Every answer names its replica; the
engines' own request counters show that none reached another model's engine."""

from __future__ import annotations

import collections
import csv
import io
import time

import httpx
import openai
import pytest

from conftest import GATEWAY_PORT
from engines import running_engine
from yieldgate.gateway.config import load_config
from yieldgate.gateway.embedded import http_status

B_HOST, B_PORT = "127.0.2.3", GATEWAY_PORT + 131
GONE = "http://127.0.2.4:9"  # nothing listens on the discard port of this loopback address
ADMIN = "many-models-admin"


@pytest.fixture(scope="module")
def engine_b(stack, tmp_path_factory):
    log = tmp_path_factory.mktemp("tiny-b") / "engine.log"
    with running_engine(stack.model_dir, B_PORT, log, "--max-model-len", "1024", "--enable-lora",
                        "--max-lora-rank", "8", "--max-loras", "2", host=B_HOST,
                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
                        served_name="tiny-b", reuse_env="YIELDGATE_TEST_TINY_B") as url:
        yield url


@pytest.fixture(scope="module")
def gateway(stack, engine_b, redis_url, tmp_path_factory):
    from yieldgate.gateway.embedded import EmbeddedGateway

    home = tmp_path_factory.mktemp("many-models")
    path = home / "yieldgate.toml"
    path.write_text(f"""
[server]
redis_url = "{redis_url}"
data_dir = "{home / 'data'}"
admin_token = "{ADMIN}"

[fleet]
model = "demo"
model_path = "{stack.model_dir}"
health_interval_s = 0.5
[[fleet.replicas]]
name = "a-standard"
url = "{stack.engines['standard']}"
[[fleet.replicas]]
name = "a-fast"
tier = "fast"
url = "{stack.engines['fast']}"

[[models]]
model = "tiny-b"
model_path = "{stack.model_dir}"
health_interval_s = 0.5
[[models.replicas]]
name = "b-0"
url = "{engine_b}"

[[models]]
model = "gone"
model_path = "{stack.model_dir}"
fallback_model = "demo"
health_interval_s = 0.5
[[models.replicas]]
name = "gone-0"
url = "{GONE}"

[aliases]
prod = "tiny-b"
[aliases.ab]
targets = [{{ model = "demo", weight = 1 }}, {{ model = "tiny-b", weight = 1 }}]
sticky = false

[auto]
enabled = true
targets = ["demo", "tiny-b"]
min_graded = 3
explore = 0.5
refresh_s = 0.3

[pricing.models.default.standard]
input = "1.00"
[pricing.models.default.fast]
input = "2.00"
[pricing.models.tiny-b.standard]
input = "0.05"
""")
    gw = EmbeddedGateway(load_config(path, env={}))
    deadline = time.monotonic() + 60
    while http_status(gw.url + "/readyz") != 200:
        assert time.monotonic() < deadline, "gateway not ready"
        time.sleep(0.2)
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def oai(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def engine_requests(url: str) -> float:
    """Requests the engine itself finished (vLLM's own counter)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total{"))


def ask(oai: openai.OpenAI, model: str, **extra):
    raw = oai.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Say one word."}], max_tokens=3, **extra)
    return raw.headers, raw.parse()


def test_the_model_list_has_both_models_their_fast_tiers_and_aliases(oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids[:4] == ["demo", "demo:fast", "tiny-b", "gone"] and {"prod", "ab", "auto"} <= set(ids)
    assert oai.models.retrieve("tiny-b").id == "tiny-b"


def test_each_model_is_served_by_its_own_engines_only(oai, stack, engine_b):
    before_b = engine_requests(engine_b)
    served = collections.Counter()
    for i in range(12):
        model = ("demo", "demo:fast", "tiny-b")[i % 3]
        headers, answer = ask(oai, model)
        served[(model, headers["x-yieldgate-replica"])] += 1
        assert answer.model == model.removesuffix(":fast")  # the engine that answered serves that name
    assert served == {("demo", "a-standard"): 4, ("demo:fast", "a-fast"): 4, ("tiny-b", "b-0"): 4}
    assert engine_requests(engine_b) - before_b == 4  # tiny-b's engine saw its 4 requests and nothing else


def test_an_alias_and_a_split_resolve_to_targets_and_say_so(oai):
    headers, answer = ask(oai, "prod")
    assert (headers["x-yieldgate-replica"], headers["x-yieldgate-model"], headers["x-yieldgate-requested-model"]) \
        == ("b-0", "tiny-b", "prod")
    assert answer.model == "tiny-b"
    split = collections.Counter(ask(oai, "ab")[0]["x-yieldgate-model"] for _ in range(16))
    assert set(split) == {"demo", "tiny-b"}  # both targets get requests (P(all 16 on one) = 2^-15)


def test_a_model_without_a_routable_replica_falls_back_to_another_priced_as_served(oai, gateway):
    deadline = time.monotonic() + 20
    while gateway.gateway.models.pool("gone").fleet.replicas["gone-0"].healthy:  # the probe marks it down
        assert time.monotonic() < deadline
        time.sleep(0.2)
    headers, answer = ask(oai, "gone", extra_headers={"x-request-id": "many-models-fallback"})
    assert (headers["x-yieldgate-model"], headers["x-yieldgate-requested-model"]) == ("demo", "gone")
    assert headers["x-yieldgate-replica"] in ("a-standard", "a-fast") and answer.model == "demo"
    metrics = httpx.get(gateway.url + "/metrics").text
    assert 'yieldgate_model_fallbacks_total{requested_model="gone",served_model="demo"}' in metrics
    health = httpx.get(gateway.url + "/healthz").json()
    assert health["models"]["gone"]["degraded_tiers"] == ["standard"] and "gone/standard" in health["degraded_tiers"]
    row = ledger_row(gateway, "many-models-fallback")
    assert (row["model"], row["requested_model"], row["target"]) == ("demo", "gone", "demo")


def test_each_model_is_priced_by_its_own_price_book_entry(oai):
    _, a = ask(oai, "demo")
    _, b = ask(oai, "tiny-b")
    # $ per 1M uncached input tokens: tiny-b's own entry, demo the default's.
    assert per_token(b) == pytest.approx(0.05e-6, rel=1e-6) and per_token(a) == pytest.approx(1e-6, rel=1e-6)


def per_token(answer) -> float:
    details = answer.usage.prompt_tokens_details
    uncached = answer.usage.prompt_tokens - (details.cached_tokens or 0 if details else 0)
    return answer.usage.model_extra["cost"]["uncached_input"] / uncached


def test_an_unknown_model_is_an_openai_404(oai):
    with pytest.raises(openai.NotFoundError) as exc:
        ask(oai, "no-such-model")
    assert (exc.value.body["code"], exc.value.body["param"]) == ("model_not_found", "model")


def ledger_row(gateway, request_id: str, timeout: float = 20) -> dict[str, str]:
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(gateway.url + "/admin/ledger.csv", headers={"authorization": f"Bearer {ADMIN}"}).text
        rows = [r for r in csv.DictReader(io.StringIO(text)) if r["request_id"] == request_id]
        if rows or time.monotonic() > deadline:
            assert len(rows) == 1, rows
            return rows[0]
        time.sleep(0.2)


def test_auto_learns_the_cheapest_target_per_solved_task_from_graded_feedback(oai, gateway):
    """demo never solves this class, tiny-b always does: once each has min_graded (3) graded tasks,
    auto sends the class to tiny-b, says why, and records what it chose."""
    auth = {"authorization": f"Bearer {ADMIN}"}
    graded = collections.Counter()
    for i in range(40):
        headers, _ = ask(oai, "auto", extra_headers={"x-yieldgate-task": "t-auto", "x-request-id": f"auto-{i}"})
        target = headers["x-yieldgate-model"]
        assert headers["x-yieldgate-requested-model"] == "auto" and headers["x-yieldgate-auto"]
        resp = httpx.post(gateway.url + "/v1/feedback", json={"request_id": f"auto-{i}", "passed": target == "tiny-b"})
        assert resp.status_code == 200, resp.text
        graded[target] += 1
        if min(graded["demo"], graded["tiny-b"]) >= 3:
            break
        time.sleep(0.4)  # the gateway reads the outcomes again every 0.3 s
    assert min(graded.values()) >= 3, graded
    deadline = time.monotonic() + 10
    while httpx.get(gateway.url + "/admin/auto", headers=auth).json()["classes"]["t-auto"].get("incumbent") != "tiny-b":
        assert time.monotonic() < deadline, httpx.get(gateway.url + "/admin/auto", headers=auth).json()
        time.sleep(0.3)
    chosen = [ask(oai, "auto", extra_headers={"x-yieldgate-task": "t-auto"})[0] for _ in range(6)]
    assert {h["x-yieldgate-model"] for h in chosen} == {"tiny-b"}, [h["x-yieldgate-auto"] for h in chosen]
    assert all("$/solved" in h["x-yieldgate-auto"] for h in chosen)
    row = ledger_row(gateway, "auto-0")
    assert (row["requested_model"], row["task"]) == ("auto", "t-auto") and row["target"] in ("demo", "tiny-b")


def test_an_adapter_of_the_second_model_is_served_by_its_engines_only(oai, gateway, stack, tmp_path):
    from pathlib import Path

    from yieldgate.serving.peft import random_adapter

    admin = httpx.Client(base_url=gateway.url, headers={"authorization": f"Bearer {ADMIN}"}, timeout=120)
    path = random_adapter(Path(stack.model_dir), tmp_path / "b-lora", seed=5)
    body = {"name": "b-lora", "version": "v1", "path": str(path), "model": "tiny-b"}
    assert admin.post("/admin/adapters", json={**body, "model": "nowhere"}).status_code == 400
    made = admin.post("/admin/adapters", json=body)
    assert made.status_code == 201, made.text
    assert made.json()["base"] == "tiny-b" and set(made.json()["replicas"]) == {"b-0"}
    # One name, one adapter: the same name on the first model is refused.
    assert admin.post("/admin/adapters", json={**body, "model": "demo"}).status_code == 409
    card = oai.models.retrieve("b-lora")
    assert card.model_extra["parent"] == "tiny-b"
    for _ in range(3):
        headers, answer = ask(oai, "b-lora")
        assert headers["x-yieldgate-replica"] == "b-0" and headers["x-yieldgate-weight-version"] == "b-lora@v1"
    assert [a["name"] for a in admin.get("/admin/adapters").json()["data"]] == ["b-lora"]
    assert admin.delete("/admin/adapters/b-lora").json()["deleted"]
    with pytest.raises(openai.NotFoundError):
        ask(oai, "b-lora")
