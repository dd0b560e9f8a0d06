"""Fleet behaviour seen through a gateway: unhealthy tiers, retries, configuration."""

from __future__ import annotations

import socket
import time

import httpx
import msgspec
import pytest

from yieldgate.gateway.app import InsecureConfig, create_app
from yieldgate.gateway.config import Config, ConfigError, load_config
from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig


def dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def fleet_config(stack, standard: list[str], fast: list[str], health_interval_s: float = 0.5,
                 fallback: bool = True) -> Config:
    replicas = [ReplicaConfig(name=f"std-{i}", tier="standard", url=u) for i, u in enumerate(standard)]
    replicas += [ReplicaConfig(name=f"fast-{i}", tier="fast", url=u) for i, u in enumerate(fast)]
    # Without tiers listed, each tier falls back to the other; listed without `fallback`, none does.
    tiers = {} if fallback else {"standard": TierConfig(), "fast": TierConfig()}
    return Config(fleet=FleetConfig(model=stack.model, replicas=replicas, tiers=tiers,
                                    health_interval_s=health_interval_s))


def chat(url: str, model: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def test_tier_without_healthy_replica_and_no_fallback_is_503(stack, gateway_factory):
    gw = gateway_factory(fleet_config(stack, [stack.engines["standard"]], [dead_url()], fallback=False))
    resp = chat(gw.url, "demo:fast")
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json()["error"]["code"] == "no_healthy_replica"
    assert chat(gw.url, "demo").status_code == 200


def test_tier_without_healthy_replica_is_served_by_its_fallback_tier_and_says_so(stack, gateway_factory):
    gw = gateway_factory(fleet_config(stack, [stack.engines["standard"]], [dead_url()]))
    resp = chat(gw.url, "demo:fast")
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-yieldgate-tier"] == "standard" and resp.headers["x-yieldgate-requested-tier"] == "fast"
    assert resp.headers["x-yieldgate-replica"] == "std-0" and resp.json()["service_tier"] == "default"
    own = chat(gw.url, "demo")
    assert "x-yieldgate-requested-tier" not in own.headers  # served by the tier it asked for
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'yieldgate_tier_failovers_total{requested_tier="fast",served_tier="standard"} 1.0' in metrics


def test_health_names_the_tier_that_cannot_serve_and_readiness_follows_fallback(stack, gateway_factory):
    for fallback in (True, False):
        gw = gateway_factory(fleet_config(stack, [stack.engines["standard"]], [dead_url()], fallback=fallback))
        deadline = time.monotonic() + 30
        while not (health := httpx.get(gw.url + "/healthz", timeout=10).json())["replicas"]["std-0"]["healthy"]:
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        # alive (200) but degraded, naming the tier and who serves its requests
        assert health["status"] == "degraded" and health["degraded_tiers"] == ["fast"]
        assert health["tiers"] == {
            "fast": {"routable": 0, "replicas": 1, "served_by": "standard" if fallback else None},
            "standard": {"routable": 1, "replicas": 1, "served_by": "standard"}}
        # ready while every tier's requests can be served: with the fallback, yes; without, no
        ready = httpx.get(gw.url + "/readyz", timeout=10)
        assert ready.status_code == (200 if fallback else 503) and ready.json()["degraded_tiers"] == ["fast"]
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'yieldgate_tier_routable_replicas{tier="fast"} 0.0' in metrics
    assert 'yieldgate_tier_routable_replicas{tier="standard"} 1.0' in metrics
    # the stack itself: every tier serves
    assert httpx.get(stack.gateway_url + "/readyz", timeout=10).status_code == 200
    assert httpx.get(stack.gateway_url + "/healthz", timeout=10).json()["status"] == "ok"


def test_request_to_a_dead_replica_is_retried_on_another(stack, gateway_factory):
    # Both replicas look healthy at first: the dead one is only found out by a request. No health
    # probe after start-up (it would find the dead replica first, racing the requests below).
    gw = gateway_factory(fleet_config(stack, [dead_url(), stack.engines["standard"]], [], health_interval_s=300))
    for r in gw.gateway.fleet.replicas.values():
        r.healthy = True
    results = [httpx.post(gw.url + "/v1/chat/completions", timeout=30, json={
        "model": "demo", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
        for i in range(4)]
    assert [r.status_code for r in results] == [200] * 4
    assert {r.headers["x-yieldgate-replica"] for r in results} == {"std-1"}
    assert not gw.gateway.fleet.replicas["std-0"].healthy
    metrics = httpx.get(gw.url + "/metrics").text
    assert 'yieldgate_upstream_retries_total{tier="standard"}' in metrics


def test_env_overrides_and_demo_fleet_default(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 9100\n[fleet]\nmodel = "m"\ndemo_base_port = 9200\n')
    config = load_config(path, env={"YIELDGATE_SERVER__PORT": "9300", "YIELDGATE_LIMITS__MAX_TOKENS": "7"})
    assert config.server.port == 9300 and config.limits.max_tokens == 7
    assert [r.name for r in config.fleet.replicas] == ["standard-0", "fast-0"]
    assert config.fleet.replicas[0].base_url == "http://127.0.0.1:9200"
    assert "--speculative-config" in config.fleet.replicas[1].launch.args
    with pytest.raises(ConfigError):
        load_config(path, env={"YIELDGATE_SERVER__PORT": "not-a-port"})
    path.write_text('[server]\nbogus = 1\n')
    with pytest.raises(ConfigError):
        load_config(path, env={})
    # Keys, budgets and limits need Redis: an empty or schemeless URL is a config error, not a
    # traceback at startup (it was one).
    for bad in ("", "127.0.0.1:6379"):
        with pytest.raises(ConfigError, match="redis_url"):
            load_config(None, env={"YIELDGATE_SERVER__REDIS_URL": bad})


def test_public_bind_without_credentials_refuses_to_start():
    config = msgspec.convert({"server": {"host": "0.0.0.0"}}, Config)
    with pytest.raises(InsecureConfig):
        create_app(config)
    config.server.allow_insecure_public = True
    create_app(config)


def test_a_replica_back_on_other_weights_than_the_store_holds_stays_out_saying_why(stack, gateway_factory):
    """A replica that returns serving other weights than its label (its engine restarted) is
    restored from the checkpoint store before it takes traffic; when the store lacks its version
    it stays out, the reason shown, and its tier's requests fail over."""
    gw = gateway_factory(fleet_config(stack, [stack.engines["standard"]], [stack.engines["fast"]]))
    std = gw.gateway.fleet.replicas["std-0"]
    deadline = time.monotonic() + 30
    while not (std.routable and std.seen_up and std.engine_started):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # Down and back on other weights than its label, same engine process (another gateway pushed,
    # say): the engine's version becomes the label, nothing is reloaded.
    std.weight_version, std.healthy = "ghost-0", False
    while std.weight_version != "base":
        assert time.monotonic() < deadline + 30, "label not read back from the engine"
        time.sleep(0.1)
    assert std.routable and not std.note and not std.restoring
    # As if its engine had restarted (another process start time) after serving a version this
    # gateway never stored:
    std.weight_version, std.healthy, std.engine_started = "ghost-1", False, std.engine_started - 1.0
    deadline = time.monotonic() + 60
    while not std.note:
        assert time.monotonic() < deadline, "no restore attempt"
        time.sleep(0.1)
    assert std.healthy and not std.routable and not std.restoring
    assert "ghost-1" in std.note and "does not hold" in std.note
    health = httpx.get(gw.url + "/healthz", timeout=10).json()
    assert health["replicas"]["std-0"]["note"] == std.note and health["degraded_tiers"] == ["standard"]
    resp = chat(gw.url, "demo")
    assert resp.status_code == 200 and resp.headers["x-yieldgate-tier"] == "fast"
    assert resp.headers["x-yieldgate-requested-tier"] == "standard"
