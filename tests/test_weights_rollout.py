"""Gateway-orchestrated weight rollouts against the real session stack (two vLLM engines running
the `yieldgate` weight-transfer backend behind `yieldgate up`).

The tests run in order and share one story: push wr-1 under load, refuse a bad canary, roll back
to base, push all at once, then two pushes that fail after the engines took them. The stack ends
on its original weights.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from yieldgate.trainer_bridge import PushFailed, PushFaults, push, write_checkpoint
from yieldgate.trainer_bridge.push import resolve_gateway_engines

pytestmark = pytest.mark.engine

PROMPT = "Once upon a time"
LONG_PROMPT = " ".join(f"The quick brown fox number {i} jumps over the lazy dog." for i in range(30))
NEW = "wr-1"


def perturbed(base: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in base.items()}


@pytest.fixture(scope="module")
def base_weights(stack) -> dict[str, torch.Tensor]:
    return load_file(str(Path(stack.model_dir) / "model.safetensors"))


@pytest.fixture(scope="module")
def story(stack, admin) -> dict:
    """Remembers outputs across the ordered tests; always hands the stack back on base weights."""
    state: dict = {}
    yield state
    versions = {r["weight_version"] for r in admin.get("/admin/weights").json()["replicas"].values()}
    if versions != {"base"}:
        admin.post("/admin/weights/rollback", json={"to_version": "base"})


def complete(gateway: str, prompt: str = PROMPT, model: str = "demo", max_tokens: int = 12) -> httpx.Response:
    return httpx.post(gateway + "/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})


def push_under_load(stack, threads: list[threading.Thread], stop: threading.Event, weights, version: str,
                    window: list[float] | None = None, **kw):
    """Push through the gateway while `threads` send requests (from 1 s before to 1 s after).
    `window` gets the push's (start, end) on the time.monotonic() clock the load records."""
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        started = time.monotonic()
        try:
            report = push(weights, version, gateway=stack.gateway_url, token=stack.admin_token,
                          progress=False, **kw)
        finally:
            if window is not None:
                window[:] = [started, time.monotonic()]
        time.sleep(1.0)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
    assert not [t for t in threads if t.is_alive()], "a load thread did not stop"
    return report


def answer(http: httpx.Client, model: str, stream: bool = False) -> tuple[str, str, int, str]:
    """One greedy completion through the gateway -> (replica, version label, status, text);
    status 0 if it raised (a dropped connection is a failed request, like a 5xx)."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": stream}
    try:
        if not stream:
            r = http.post("/v1/completions", json=body)
            text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text[:200]
        else:
            with http.stream("POST", "/v1/completions", json=body) as r:
                chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
                text = "".join(choice["text"] for c in chunks for choice in json.loads(c).get("choices", []))
    except Exception as exc:  # noqa: BLE001 - recorded, and the test fails on it
        return "", "", 0, f"{type(exc).__name__}: {exc}"
    return (r.headers.get("x-yieldgate-replica", ""), r.headers.get("x-yieldgate-weight-version", ""),
            r.status_code, text)


def recorded_load(stack, seen: list, stop: threading.Event, model: str) -> threading.Thread:
    """A client that keeps asking `model` for the same greedy completion; records (model, status,
    version label, text, time.monotonic()) of every answer (status 0: the request raised)."""

    def run() -> None:
        with httpx.Client(base_url=stack.gateway_url, timeout=120) as http:
            while not stop.is_set():
                _, version, status, text = answer(http, model)
                seen.append((model, status, version, text, time.monotonic()))

    return threading.Thread(target=run)


def snapshot_texts(stack) -> dict[str, str]:
    return {m: complete(stack.gateway_url, model=m, max_tokens=4).json()["choices"][0]["text"]
            for m in ("demo", "demo:fast")}


def base_and_recorded_load(stack, admin) -> tuple[dict[str, str], list[tuple[str, int, str, str, float]],
                                                  list[threading.Thread], threading.Event]:
    """For a push expected to leave base in place: what base answers per model, and one
    `recorded_load` client per model (not started: `push_under_load` runs them)."""
    assert set(versions(admin).values()) == {"base"}
    base_text = snapshot_texts(stack)
    seen: list[tuple[str, int, str, str, float]] = []  # (model, status, version label, text, t)
    stop = threading.Event()
    threads = [recorded_load(stack, seen, stop, m) for m in ("demo", "demo:fast")]
    return base_text, seen, threads, stop


def versions(admin: httpx.Client) -> dict[str, str]:
    return {n: r["weight_version"] for n, r in admin.get("/admin/weights").json()["replicas"].items()}


def test_unauthenticated_rollout_is_refused(stack, admin, story):
    before = versions(admin)
    resp = httpx.post(stack.gateway_url + "/admin/weights", json={"version": "evil", "source": "push"})
    assert resp.status_code == 401
    assert resp.json()["error"]["code"] == "invalid_admin_token"
    assert httpx.get(stack.gateway_url + "/admin/weight_targets").status_code == 401
    assert httpx.post(stack.gateway_url + "/admin/weights/push", json={}).status_code == 401
    assert versions(admin) == before
    story["base_text"] = complete(stack.gateway_url).json()["choices"][0]["text"]


def test_push_through_gateway_rolls_under_load(stack, admin, story, base_weights):
    # Warm the standard engine's prefix cache with a long prompt: the repeat is served from cache.
    engine = stack.engines["standard"]
    for _ in range(2):
        usage = complete(engine, LONG_PROMPT, max_tokens=1).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0

    base_text = snapshot_texts(stack)
    seen: list[tuple[float, str, str, int, str, str]] = []  # (t, replica, version, status, text, model)
    stop = threading.Event()

    def load(model: str) -> None:
        with httpx.Client(base_url=stack.gateway_url, timeout=120) as http:
            while not stop.is_set():
                replica, version, status, text = answer(http, model)
                seen.append((time.monotonic(), replica, version, status, text, model))

    threads = [threading.Thread(target=load, args=(m,)) for m in ("demo", "demo:fast")]
    window: list[float] = []
    report = push_under_load(stack, threads, stop, perturbed(base_weights, 1), NEW, window=window)

    assert report.version == NEW
    failed = [s for s in seen if s[3] != 200]
    assert not failed, failed[:5]
    assert set(versions(admin).values()) == {NEW}
    # Served throughout: answers came back while the push ran.
    during = [s for s in seen if window[0] <= s[0] <= window[1]]
    assert during, f"no answer during the {window[1] - window[0]:.1f} s push"
    # The label is the truth: each response's text is that of the weights it names.
    expected = {"base": base_text, NEW: snapshot_texts(stack)}
    assert expected[NEW] != base_text
    wrong = [s for s in seen if s[4] != expected[s[2]][s[5]]]
    assert not wrong, wrong[:5]
    # A clean switch per replica: once a replica answered with NEW, it never answers with base.
    for replica in {s[1] for s in seen}:
        served = [s[2] for s in sorted(seen) if s[1] == replica]
        assert served == sorted(served, key=lambda v: v == NEW), (replica, served)

    state = admin.get("/admin/weights").json()["rollout"]
    assert state["state"] == "succeeded" and state["version"] == NEW
    events = [e["event"] for e in state["timeline"]]
    assert events.count("admitted") == len(stack.engines)
    # It rolled: the other replica left routing only once the first was back on the new weights,
    # so one tier's replica served NEW while the other still served base. (Whether an answer
    # lands in that gap is a race; the order is not.)
    order = [(e["event"], e["replica"]) for e in state["timeline"] if e["event"] in ("drain", "admitted")]
    first = order[0][1]
    back = order.index(("admitted", first))
    assert {replica for _, replica in order[:back]} == {first}, order
    assert ("drain", first) not in order[back:] and any(
        event == "drain" and replica != first for event, replica in order[back:]), order
    # Every engine runs the plugin, so the trainer streamed to each one directly (fan-out).
    assert events.count("staging") == len(stack.engines) and "staged" not in events
    assert len(report.engines) == len(stack.engines) + 1  # + the gateway's checkpoint copy

    # Prefix cache was reset by the update: the long prompt is computed afresh.
    usage = complete(engine, LONG_PROMPT, max_tokens=1).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0

    resp = complete(stack.gateway_url)
    assert resp.headers["x-yieldgate-weight-version"] == NEW
    assert resp.json()["system_fingerprint"] == f"yieldgate-{NEW}"
    story["new_text"] = resp.json()["choices"][0]["text"]
    assert story["new_text"] != story["base_text"]


def test_failed_canary_keeps_serving_old_weights(stack, admin, story, base_weights, tmp_path):
    ckpt = write_checkpoint(perturbed(base_weights, 2), stack.model_dir, tmp_path / "bad")
    resp = admin.post("/admin/weights", json={
        "version": "wr-bad", "source": {"checkpoint": str(ckpt)}, "mode": "rolling", "wait": True,
        "canary": {"prompt": PROMPT, "expect_substring": "no model says this \u2603"}})
    assert resp.status_code == 200, resp.text
    state = resp.json()["rollout"]
    assert state["state"] == "failed"
    assert "evaluation" in state["reason"]
    assert state["failed_replica"]
    assert set(versions(admin).values()) == {NEW}
    for model in ("demo", "demo:fast"):
        r = complete(stack.gateway_url, model=model)
        assert r.headers["x-yieldgate-weight-version"] == NEW
        assert r.json()["choices"][0]["text"] == story["new_text"]


def test_rollback_to_previous_version_in_one_call(stack, admin, story):
    resp = admin.post("/admin/weights/rollback", json={})
    assert resp.status_code == 200, resp.text
    assert resp.json()["rollout"]["version"] == "base"
    assert set(versions(admin).values()) == {"base"}
    r = complete(stack.gateway_url)
    assert r.headers["x-yieldgate-weight-version"] == "base"
    assert r.json()["choices"][0]["text"] == story["base_text"]


def test_all_at_once_push_holds_requests_and_labels_every_response(stack, admin, story, base_weights):
    """mode all_at_once: every replica drains together while the gateway holds new requests,
    then all apply the staged weights. No request fails, and every response (streamed too) is
    labelled with the weights that produced it: greedy text identifies the version."""
    newer = "wr-2"
    seen: list[tuple[float, str, str, int, str, bool, str]] = []  # (t, replica, version, status, text, stream, model)
    stop = threading.Event()

    def load(model: str, stream: bool) -> None:
        with httpx.Client(base_url=stack.gateway_url, timeout=120) as http:
            while not stop.is_set():
                seen.append((time.monotonic(), *answer(http, model, stream), stream, model))

    def texts() -> dict[tuple[str, bool], str]:  # what the weights served now say, per model, streamed and not
        with httpx.Client(base_url=stack.gateway_url, timeout=120) as http:
            return {(m, stream): answer(http, m, stream)[3] for m in ("demo", "demo:fast")
                    for stream in (False, True)}

    base_text = texts()
    threads = [threading.Thread(target=load, args=(m, s))
               for m in ("demo", "demo:fast") for s in (False, True)]
    window: list[float] = []
    report = push_under_load(stack, threads, stop, perturbed(base_weights, 3), newer, window=window,
                             mode="all_at_once")

    assert report.version == newer
    failed = [s for s in seen if s[3] != 200]
    assert not failed, failed[:5]
    assert {s[2] for s in seen} == {"base", newer}
    # Requests were answered while the push ran (the hold is only the swap's few moments).
    assert [s for s in seen if window[0] <= s[0] <= window[1]], "nothing answered during the push"
    new_text = texts()
    assert new_text[("demo", False)] != base_text[("demo", False)]
    # The label is the truth: base-labelled responses are the base weights' text, new-labelled ones
    # the new weights' (a request held during the swap is routed, and labelled, only afterwards).
    expected = {"base": base_text, newer: new_text}
    wrong = [s for s in seen if s[4] != expected[s[2]][(s[6], s[5])]]
    assert not wrong, wrong[:5]
    assert set(versions(admin).values()) == {newer}

    state = admin.get("/admin/weights").json()["rollout"]
    assert state["state"] == "succeeded" and state["mode"] == "all_at_once"
    events = [(e["event"], e["replica"]) for e in state["timeline"]]
    names = [e[0] for e in events]
    assert names.count("hold") == 1 and names.count("released") == 1
    # One drain for the whole fleet: every replica was out before any applied the new weights.
    last_drain = max(i for i, (e, _) in enumerate(events) if e == "drain")
    first_update = min(i for i, (e, _) in enumerate(events) if e == "update")
    assert last_drain < first_update
    assert names.count("admitted") == len(stack.engines)
    assert names.index("released") > max(i for i, (e, _) in enumerate(events) if e == "admitted")

    resp = admin.post("/admin/weights/rollback", json={"to_version": "base"})
    assert resp.status_code == 200, resp.text
    assert set(versions(admin).values()) == {"base"}


def test_all_at_once_failure_on_one_engine_restores_every_replica(stack, admin, story, base_weights):
    """One engine receives a corrupted chunk during an all_at_once update: its apply fails, so
    every replica goes back to N-1 before the held requests are released. None of them fails,
    and none is answered by the weights that never went live."""
    bad = "wr-corrupt"
    base_text, seen, threads, stop = base_and_recorded_load(stack, admin)
    faults = PushFaults(corrupt_chunk=3, only=lambda url: url.endswith("/engine/fast-0"))
    window: list[float] = []
    with pytest.raises(PushFailed) as failure:
        push_under_load(stack, threads, stop, perturbed(base_weights, 4), bad, window=window,
                        mode="all_at_once", faults=faults)
    assert "ChecksumMismatch" in str(failure.value)

    state = admin.get("/admin/weights").json()["rollout"]
    assert state["state"] == "failed" and state["mode"] == "all_at_once" and state["version"] == bad
    assert state["failed_replica"] == "fast-0"
    assert "checksum" in state["reason"].lower(), state["reason"]
    events = [e["event"] for e in state["timeline"]]
    assert events.count("hold") == 1 and events.count("released") == 1
    # Both replicas were restored (re-admitted on base) before the hold was lifted.
    restored = [i for i, e in enumerate(state["timeline"])
                if e["event"] == "admitted" and e["detail"] == "base"]
    assert len(restored) == len(stack.engines)
    assert events.index("released") > max(restored)

    assert seen and not [s for s in seen if s[1] != 200], [s for s in seen if s[1] != 200][:5]
    assert {s[2] for s in seen} == {"base"}
    assert all(text == base_text[model] for model, _, _, text, _ in seen)
    assert [s for s in seen if window[0] <= s[4] <= window[1]], "nothing answered during the push"
    assert set(versions(admin).values()) == {"base"}
    assert bad not in admin.get("/admin/weights").json()["versions"]
    assert snapshot_texts(stack) == base_text


def test_failed_checkpoint_copy_fails_the_rollout_and_restores_n_minus_1(stack, admin, story, base_weights):
    """The engines take the push, but the gateway's own copy (the checkpoint rollback needs)
    fails its checksums: the rollout fails once the engines swapped, and N-1 is restored."""
    new = "wr-nocopy"
    base_text, seen, threads, stop = base_and_recorded_load(stack, admin)
    faults = PushFaults(corrupt_chunk=3, only=lambda url: "/engine/" not in url)  # the gateway's intake
    window: list[float] = []
    with pytest.raises(PushFailed):
        push_under_load(stack, threads, stop, perturbed(base_weights, 5), new, window=window, faults=faults)

    state = admin.get("/admin/weights").json()["rollout"]
    assert state["state"] == "failed" and state["version"] == new
    assert "checkpoint" in state["reason"] and "checksum" in state["reason"].lower(), state["reason"]
    events = [e["event"] for e in state["timeline"]]
    assert events.count("verified") == len(stack.engines)  # the engines did swap first
    assert not [s for s in seen if s[1] != 200], [s for s in seen if s[1] != 200][:5]
    assert {s[2] for s in seen} <= {"base", new}
    assert all(text == base_text[model] for model, _, version, text, _ in seen if version == "base")
    assert [s for s in seen if window[0] <= s[4] <= window[1]], "nothing answered during the push"
    assert set(versions(admin).values()) == {"base"}
    assert new not in admin.get("/admin/weights").json()["versions"]
    assert snapshot_texts(stack) == base_text


def test_push_announce_refuses_a_malformed_stream_without_touching_the_fleet(stack, admin, story):
    """`POST /admin/weights/push` validates the stream description before any engine is asked:
    a refused announce opens nothing and takes no replica out of routing."""
    before = admin.get("/admin/weights").json()
    stream = {"names": ["a", "b"], "dtype_names": ["bfloat16"], "shapes": [[2], [2]],
              "sender": "127.0.0.1:9", "checksum": "crc32", "timeout_s": 5}
    for body in ({"version": "wr-x", "stream": stream},                          # lengths differ
                 {"version": "base", "stream": {**stream, "dtype_names": ["bfloat16"] * 2}},
                 {"version": "wr-x", "stream": {**stream, "dtype_names": ["bfloat16"] * 2,
                                                "checksum": "md5"}},
                 {"version": "wr-x", "mode": "sometimes", "stream": stream}):
        resp = admin.post("/admin/weights/push", json=body)
        assert resp.status_code == 400, (body, resp.text)
        assert resp.json()["error"]["type"] == "invalid_request_error"
    after = admin.get("/admin/weights").json()
    assert after["rollout"] == before["rollout"]
    assert all(r["admitted"] for r in after["replicas"].values())
    assert set(versions(admin).values()) == {"base"}


def test_engine_shaped_intakes_still_take_a_push(stack, admin, story, base_weights):
    """The one-call announce is what push(gateway=) uses; trainers that speak vLLM's four
    weight-sync calls still push through the intakes `weight_targets` lists (init, start,
    update, finish on each), and the rollout lands the same way."""
    version = "wr-intakes"
    engines, token, dtype = resolve_gateway_engines(stack.gateway_url, stack.admin_token,
                                                    "rolling", version)
    assert len(engines) == len(stack.engines) + 1 and all("/weights/intake/" in e for e in engines)
    report = push(perturbed(base_weights, 6), version, engines=engines, token=token, dtype=dtype,
                  progress=False)
    assert report.version == version
    state = admin.get("/admin/weights").json()["rollout"]
    assert state["state"] == "succeeded" and state["version"] == version, state.get("reason")
    events = [e["event"] for e in state["timeline"]]
    assert events.count("staging") == len(stack.engines)
    assert events.count("admitted") == len(stack.engines)
    assert set(versions(admin).values()) == {version}
    resp = complete(stack.gateway_url)
    assert resp.headers["x-yieldgate-weight-version"] == version
    rolled_back = admin.post("/admin/weights/rollback", json={"to_version": "base"})
    assert rolled_back.status_code == 200, rolled_back.text
    assert set(versions(admin).values()) == {"base"}
