"""The emulated fleet (serving/emulator.py): its prefix cache, its KV events as the gateway's own
subscriber reads them, and a small fleet behind a real yieldgate gateway. No vLLM engine runs here:
the emulator exists to route over more engines than this machine holds (docs/emulated-fleet.md)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from yieldgate.cache import BlockHashConfig, BlockHasher, KVEventSubscriber, PrefixIndex, Tokenizer
from yieldgate.serving.demo_model import ensure_demo_model
from yieldgate.serving.emulator import CALIBRATED, EmulatedFleet, EmulatorConfig

ROOT = Path(__file__).resolve().parent.parent
PORT = int(os.environ.get("YIELDGATE_TEST_PORT_BASE", "18000")) + 500
KV_BLOCKS = 96
BS = 32


class FleetThread:
    """An emulated fleet on an event loop of its own, in a background thread."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True, name="emulated-fleet")
        self.thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"emulated fleet did not start: {self._error!r}")

    def _run(self) -> None:
        async def main() -> None:
            self._stop = asyncio.Event()
            try:
                async with EmulatedFleet(self.config) as fleet:
                    self.fleet = fleet
                    self._ready.set()
                    await self._stop.wait()
            except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
                self._error = exc
                self._ready.set()

        self.loop.run_until_complete(main())

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fleet() -> Iterator[FleetThread]:
    engine = msgspec.structs.replace(CALIBRATED["tiny"], kv_capacity_blocks=KV_BLOCKS)
    f = FleetThread(EmulatorConfig(engines=4, port=PORT, kv_events_port=PORT + 1, engine=engine))
    yield f
    f.stop()


def completion(url: str, prompt: list[int], max_tokens: int = 2, stream: bool = False) -> dict:
    body = {"model": "demo", "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        r.raise_for_status()
        return r.json()["usage"]
    body["stream_options"] = {"include_usage": True}
    usage, texts = {}, []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                usage = event.get("usage") or usage
                texts += [c["text"] for c in event["choices"]]
    assert len(texts) == max_tokens
    return usage


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def test_a_repeated_prefix_is_reported_cached(fleet):
    url = fleet.config.url(0)
    prompt = tokens(1, 20 * BS + 5)
    first = completion(url, prompt)
    assert first["prompt_tokens"] == len(prompt)
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    again = completion(url, prompt[:18 * BS] + tokens(2, 40), stream=True)
    assert again["prompt_tokens_details"]["cached_tokens"] == 18 * BS  # the shared full blocks
    # Another engine never saw it.
    assert completion(fleet.config.url(1), prompt)["prompt_tokens_details"]["cached_tokens"] == 0


def test_the_cache_evicts_the_least_recently_used_blocks_under_pressure(fleet):
    url = fleet.config.url(2)
    a, b, c = (tokens(10 + i, 40 * BS + 1) for i in range(3))  # 40 blocks each; the engine holds 96
    completion(url, a)
    completion(url, b)
    completion(url, a)  # a is now the most recently used
    completion(url, c)  # evicts b's blocks, not a's
    assert completion(url, a)["prompt_tokens_details"]["cached_tokens"] == 40 * BS
    assert completion(url, b)["prompt_tokens_details"]["cached_tokens"] < 40 * BS
    metrics = httpx.get(url + "/metrics").text
    assert f'num_gpu_blocks="{KV_BLOCKS}"' in metrics
    assert "vllm:prefix_cache_hits_total" in metrics


def test_kv_events_move_the_gateways_prefix_index(fleet):
    """The gateway's own subscriber and hasher, on the gateway's tokenization of a chat prompt: the
    index learns what the engine stored, then forgets it when the engine evicts or resets."""
    url, endpoint = fleet.config.url(3), fleet.config.kv_endpoint(3)
    tok = Tokenizer.from_model_dir(ensure_demo_model())
    hasher = BlockHasher(BlockHashConfig(block_size=BS, hash_seed="0"))
    messages = [{"role": "system", "content": "You review code for a bank. " * 120},
                {"role": "user", "content": "Is this safe?"}]
    hashes = hasher.hashes(tok.encode_chat(messages))
    assert len(hashes) > 10

    async def follow() -> tuple[int, int, int]:
        index = PrefixIndex()
        sub = KVEventSubscriber("emulated-3", endpoint, index)
        sub.start()
        await asyncio.sleep(0.5)  # the SUB socket joins before the first event
        try:
            r = await asyncio.to_thread(httpx.post, url + "/v1/chat/completions", timeout=30,
                                        json={"model": "demo", "messages": messages, "max_tokens": 2})
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            await asyncio.sleep(0.3)
            held = index.match(hashes).get("emulated-3", 0)
            # Other prompts push it out of the 96-block cache: BlockRemoved.
            for i in range(3):
                await asyncio.to_thread(completion, url, tokens(100 + i, 40 * BS + 1))
            await asyncio.sleep(0.3)
            evicted = index.match(hashes).get("emulated-3", 0)
            await asyncio.to_thread(completion, url, tokens(200, 10 * BS + 1))
            await asyncio.sleep(0.3)
            before_reset = len(index.blocks("emulated-3"))
            assert before_reset > 0
            assert (await asyncio.to_thread(httpx.post, url + "/reset_prefix_cache")).json() == {"success": True}
            await asyncio.sleep(0.3)
            return held, evicted, len(index.blocks("emulated-3"))
        finally:
            await sub.stop()

    held, evicted, after_reset = asyncio.run(follow())
    assert held == len(hashes)  # every full block of the prompt, by the gateway's own hashes
    assert evicted < held
    assert after_reset == 0  # AllBlocksCleared emptied the replica's slot


def test_a_gateway_routes_repeated_prefixes_to_the_replica_holding_them(fleet, tmp_path, redis_url):
    import redis

    from yieldgate.gateway.config import Config, ServerConfig
    from yieldgate.gateway.embedded import EmbeddedGateway
    from yieldgate.serving.config import FleetConfig, ReplicaConfig, TierConfig

    for i in range(4):  # start from empty caches: earlier tests filled them
        assert httpx.post(fleet.config.url(i) + "/reset_prefix_cache").json()["success"]
    names = [f"emu-t{i}" for i in range(4)]
    replicas = [ReplicaConfig(name=n, tier="standard", url=fleet.config.url(i),
                              kv_events_endpoint=fleet.config.kv_endpoint(i)) for i, n in enumerate(names)]
    config = Config(server=ServerConfig(redis_url=redis_url, data_dir=str(tmp_path / "data")),
                    fleet=FleetConfig(model="demo", model_path=str(ensure_demo_model()), block_size=BS,
                                      replicas=replicas, tiers={"standard": TierConfig(policy="cache_aware")},
                                      health_interval_s=0.5, scrape_interval_s=0.5))
    gw = EmbeddedGateway(config)
    try:
        client = httpx.Client(base_url=gw.url, timeout=30)
        deadline = time.monotonic() + 30
        while client.get("/readyz").status_code != 200:
            assert time.monotonic() < deadline, "the gateway never saw its replicas healthy"
            time.sleep(0.2)
        time.sleep(1.0)  # its KV-event subscribers have joined the engines' publishers
        tenants = [f"Tenant {t} support policy: " + " ".join(f"rule{t}-{k}" for k in range(120)) for t in range(6)]
        served: dict[int, list[str]] = {t: [] for t in range(6)}
        cached: dict[int, list[int]] = {t: [] for t in range(6)}
        for rnd in range(3):
            for t, system in enumerate(tenants):
                r = client.post("/v1/chat/completions", json={
                    "model": "demo", "max_tokens": 2,
                    "messages": [{"role": "system", "content": system},
                                 {"role": "user", "content": f"question {rnd} from user {t}"}]})
                assert r.status_code == 200, r.text
                served[t].append(r.headers["x-yieldgate-replica"])
                cached[t].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        for t in range(6):
            assert len(set(served[t])) == 1, served  # every repeat went where the prefix was
            assert cached[t][0] == 0 and min(cached[t][1:]) > 300, cached
        assert len({s[0] for s in served.values()}) > 1  # the tenants were spread, not piled on one
    finally:
        gw.stop()
        with redis.Redis.from_url(redis_url) as r:
            keys = [k for n in names for k in r.scan_iter(f"yg:prefix:demo:r:{n}*")]
            if keys:
                r.delete(*keys)


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_the_emulators_latency_model_is_the_fit_of_the_calibration_run(model):
    """serving/emulator.py's figures are what benchmarks/emulator_calibration.py fitted on a real engine."""
    fit = json.loads((ROOT / "benchmarks" / "results" / f"emulator-calibration-{model}.json").read_text())["fit"]
    engine = CALIBRATED[model]
    for key in ("prefill_s_per_token", "context_s_per_token", "step_s", "decode_s_per_seq"):
        assert getattr(engine, key) == pytest.approx(fit[key], rel=0.01, abs=1e-9), key
