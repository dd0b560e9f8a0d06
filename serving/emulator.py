"""An emulated vLLM fleet: many fake OpenAI-compatible engines in one process, to route over more
engines than this machine can run. No model runs: it is an emulation (docs/emulated-fleet.md).

Each engine listens on a loopback address of its own and answers what a router asks a vLLM
engine: /v1/chat/completions and /v1/completions (streamed or not, usage with
prompt_tokens_details.cached_tokens), /v1/models, /health, /metrics (vLLM's metric names),
/weight_info and /reset_prefix_cache, and publishes KV events over ZMQ in vLLM's format.
Its prefix cache and batching are the fleet simulator's engine (cache.simulator.SimReplica: a
bounded block pool with LRU eviction, continuous batching with per-token prefill and per-step
decode costs) run on the event loop's clock; prompts are rendered, tokenized and hashed as the
gateway does (cache.Tokenizer, cache.BlockHasher), so its block hashes are a real engine's.

    yieldgate emulate --engines 32 --kv-blocks 512     # 127.0.14.1:26000 ... 127.0.14.32:26000
"""

from __future__ import annotations

import asyncio
import ipaddress
import itertools
import logging
import time
from collections.abc import Callable
from typing import Any

import httptools
import msgspec

from yieldgate.cache import BlockHashConfig, BlockHasher, BlockStored, KVEventPublisher, Tokenizer
from yieldgate.cache.kv_events import AllBlocksCleared, BlockRemoved
from yieldgate.cache.simulator import EngineModel, PrefixOracle, SimReplica, SimRequest

log = logging.getLogger("yieldgate.emulator")

# A demo engine (standard-0's flags: --max-num-seqs 64) on each built-in model, as
# benchmarks/emulator_calibration.py measured and fitted it on one real engine; the measurements are in
# benchmarks/results/emulator-calibration-MODEL.json (a test checks these figures are that fit).
CALIBRATED: dict[str, EngineModel] = {
    "tiny": EngineModel(prefill_s_per_token=7.27e-6, context_s_per_token=1.10e-6, step_s=1.69e-3,
                        decode_s_per_seq=2.38e-4, max_running=64, max_batched_tokens=2048, kv_capacity_blocks=512),
    "smollm2": EngineModel(prefill_s_per_token=9.21e-4, context_s_per_token=1.66e-4, step_s=8.39e-2,
                           decode_s_per_seq=2.66e-3, max_running=64, max_batched_tokens=2048, kv_capacity_blocks=512),
}


class EmulatorConfig(msgspec.Struct, kw_only=True, frozen=True):
    engines: int = 32
    first_address: str = "127.0.14.1"  # engine i listens on first_address + i (loopback only)
    port: int = 26000                  # every engine's HTTP port, each on its own address
    kv_events_port: int = 26001        # every engine's KV-event publisher (0: none)
    model: str = "demo"                # the served model name
    model_path: str = ""               # tokenizer and chat template; "" = the generated demo model
    block_size: int = 32
    hash_seed: str | None = "0"        # the PYTHONHASHSEED a real engine would run with
    default_max_tokens: int = 16
    engine: EngineModel = CALIBRATED["tiny"]  # its kv_capacity_blocks is each engine's cache size

    def address(self, i: int) -> str:
        addr = ipaddress.ip_address(self.first_address) + i
        if not addr.is_loopback:
            raise ValueError(f"emulated engine {i} would listen on {addr}: emulated engines stay on loopback")
        return str(addr)

    def url(self, i: int) -> str:
        return f"http://{self.address(i)}:{self.port}"

    def kv_endpoint(self, i: int) -> str:
        return f"tcp://{self.address(i)}:{self.kv_events_port}" if self.kv_events_port else ""


class _HostConfig(msgspec.Struct, frozen=True):
    block_size: int
    scrape_interval_s: float = 0.0


class _Completion:
    """One request's progress: set when its first token is out and when it is done."""

    __slots__ = ("req", "first", "done")

    def __init__(self, req: SimRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.req = req
        self.first = loop.create_future()
        self.done = loop.create_future()


class EmulatedEngine:
    """One fake vLLM engine: the simulator's engine model on real time, behind an HTTP port."""

    def __init__(self, fleet: "EmulatedFleet", index: int) -> None:
        cfg = fleet.config
        self.fleet = fleet
        self.name = f"emulated-{index}"
        self.index = index
        self.host, self.port = cfg.address(index), cfg.port
        self.config = _HostConfig(cfg.block_size)
        self._loop = asyncio.get_running_loop()
        self._t0 = self._loop.time()
        self.replica = SimReplica(self, self.name, cfg.engine)
        self.publisher = KVEventPublisher(cfg.kv_endpoint(index)) if cfg.kv_events_port else None
        self._resetting = False
        self._ids = itertools.count()
        self.server: asyncio.Server | None = None
        # vLLM's counters (tokens, requests); oracle: what an infinite fleet-wide cache would have held
        self.prompt_tokens = self.cached_tokens = self.generation_tokens = self.requests = 0
        self.oracle_cached_tokens = 0

    # -- EngineHost: the event loop's clock; KV events out over ZMQ ---------------------------------
    @property
    def now(self) -> float:
        return self._loop.time() - self._t0

    def schedule(self, at: float, fn: Callable[..., None], *args: Any) -> None:
        self._loop.call_at(self._t0 + at, fn, *args)

    def blocks_stored(self, replica: SimReplica, req: SimRequest, hashes: list) -> None:
        """One BlockStored per run of consecutive new blocks, with its parent and tokens, as vLLM."""
        if self.publisher is None:
            return
        bs = self.config.block_size
        at = {h: i for i, h in enumerate(req.hashes)}
        run: list = []
        for h in hashes:
            if run and at[h] != at[run[-1]] + 1:
                self._publish_run(req, run, at, bs)
                run = []
            run.append(h)
        if run:
            self._publish_run(req, run, at, bs)

    def _publish_run(self, req: SimRequest, run: list, at: dict, bs: int) -> None:
        first = at[run[0]]
        assert self.publisher is not None
        self.publisher.add(BlockStored(block_hashes=run, parent_block_hash=req.hashes[first - 1] if first else None,
                                       token_ids=req.tokens[first * bs:(first + len(run)) * bs], block_size=bs,
                                       medium="GPU"))

    def blocks_removed(self, replica: SimReplica, hashes: list) -> None:
        if self.publisher is not None and not self._resetting:
            self.publisher.add(BlockRemoved(block_hashes=hashes, medium="GPU"))

    # -- requests ---------------------------------------------------------------------------------
    def submit(self, tokens: list[int], packed: bytes | None, max_tokens: int) -> _Completion:
        fleet = self.fleet
        hashes = fleet.hasher.hashes(tokens, packed)
        req = SimRequest(next(self._ids), "", 0, tokens, hashes, max_tokens, self.now)
        self.oracle_cached_tokens += fleet.oracle.observe(hashes, len(tokens)) * self.config.block_size
        done = _Completion(req, self._loop)
        req.on_first_token = lambda: self._first_token(done)
        req.done_cb = lambda r, now: self._finished(done)
        self.replica.submit(req)
        return done

    def _first_token(self, c: _Completion) -> None:
        req = c.req
        self.prompt_tokens += req.n_prompt
        self.cached_tokens += req.cached_blocks * self.config.block_size
        if not c.first.done():
            c.first.set_result(None)

    def _finished(self, c: _Completion) -> None:
        self.requests += 1
        self.generation_tokens += c.req.n_out
        if not c.done.done():
            c.done.set_result(None)

    def token_interval(self) -> float:
        """The decode step time at today's batch: the pace of a stream's tokens after the first."""
        m = self.replica.model
        return m.step_s + m.decode_s_per_seq * max(1, len(self.replica.running))

    def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: refused while requests hold blocks; else AllBlocksCleared."""
        if self.replica.running or self.replica.waiting:
            return False
        self._resetting = True
        try:
            self.replica.cache.clear()
        finally:
            self._resetting = False
        if self.publisher is not None:
            self.publisher.add(AllBlocksCleared())
        return True

    def metrics(self) -> bytes:
        r = self.replica
        labels = f'model_name="{self.fleet.config.model}",engine="0"'
        used = r.cache.used() / r.cache.capacity if r.cache.capacity else 0.0
        rows = [
            ("vllm:num_requests_running", "gauge", "", len(r.running)),
            ("vllm:num_requests_waiting", "gauge", "", len(r.waiting)),
            ("vllm:kv_cache_usage_perc", "gauge", "", used),
            ("vllm:prefix_cache_queries", "counter", "", self.prompt_tokens),
            ("vllm:prefix_cache_hits", "counter", "", self.cached_tokens),
            ("vllm:prompt_tokens", "counter", "", self.prompt_tokens),
            ("vllm:generation_tokens", "counter", "", self.generation_tokens),
            ("vllm:request_success", "counter", ',finished_reason="length"', self.requests),
            ("vllm:prompt_tokens_by_source", "counter", ',source="local_cache_hit"', self.cached_tokens),
            ("vllm:prompt_tokens_by_source", "counter", ',source="local_compute"',
             self.prompt_tokens - self.cached_tokens),
            # Not a vLLM metric: the emulated fleet's oracle (cache.simulator.PrefixOracle) for the
            # requests this engine received, for benchmarks to compare routers with.
            ("yieldgate_emulator_oracle_cached_tokens", "counter", "", self.oracle_cached_tokens),
        ]
        out, typed = [], set()
        for name, kind, extra, value in rows:
            if name not in typed:
                out.append(f"# TYPE {name} {kind}")
                typed.add(name)
            suffix = "_total" if kind == "counter" else ""
            out.append(f"{name}{suffix}{{{labels}{extra}}} {value}")
        out.append("# TYPE vllm:cache_config_info gauge")
        out.append(f'vllm:cache_config_info{{block_size="{self.config.block_size}",'
                   f'num_gpu_blocks="{r.cache.capacity}",enable_prefix_caching="True"}} 1.0')
        out.append("# TYPE process_start_time_seconds gauge")
        out.append(f"process_start_time_seconds {self.fleet.started_at}")
        return ("\n".join(out) + "\n").encode()

    # -- serving ----------------------------------------------------------------------------------
    async def start(self) -> None:
        self.server = await self._loop.create_server(lambda: _Connection(self), self.host, self.port,
                                                     backlog=1024, reuse_address=True)

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.publisher is not None:
            self.publisher.close()


class EmulatedFleet:
    """`config.engines` emulated engines in this process, sharing one tokenizer, block hasher and
    oracle.

    >>> async with EmulatedFleet(EmulatorConfig(engines=4)) as fleet:
    ...     fleet.urls()   # ["http://127.0.14.1:26000", ...]
    """

    def __init__(self, config: EmulatorConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        if tokenizer is None:
            from .demo_model import ensure_demo_model

            tokenizer = Tokenizer.from_model_dir(config.model_path or ensure_demo_model())
        self.tokenizer = tokenizer
        self.hasher = BlockHasher(BlockHashConfig(block_size=config.block_size, hash_seed=config.hash_seed))
        self.oracle = PrefixOracle(config.block_size)
        self.engines: list[EmulatedEngine] = []
        self.started_at = time.time()

    async def __aenter__(self) -> "EmulatedFleet":
        self.engines = [EmulatedEngine(self, i) for i in range(self.config.engines)]
        try:
            await asyncio.gather(*(e.start() for e in self.engines))
        except BaseException:
            await self.close()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await asyncio.gather(*(e.close() for e in self.engines))

    def urls(self) -> list[str]:
        return [self.config.url(i) for i in range(self.config.engines)]

    def kv_endpoints(self) -> list[str]:
        return [self.config.kv_endpoint(i) for i in range(self.config.engines)]

    def prompt(self, chat: bool, body: dict) -> tuple[list[int], bytes | None]:
        """The prompt's token ids as vLLM builds them (chat template, or the completion prompt)."""
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            return self.tokenizer.encode_chat_packed(messages, body.get("tools"))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
            prompt = prompt[0]  # a batch of prompts: the emulator serves the first
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt), None
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return prompt, None
        raise ValueError("prompt must be a non-empty string or a list of token ids")


# -- HTTP ------------------------------------------------------------------------------------------

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
_TOKEN_TEXT = " ok"  # every generated token (no model runs; the text is filler)


def _error(message: str, kind: str = "BadRequestError", code: int = 400) -> bytes:
    return _encode({"object": "error", "message": message, "type": kind, "param": None, "code": code})


class _Connection(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection to an emulated engine (httptools, no framework: one
    process serves dozens of engines)."""

    def __init__(self, engine: EmulatedEngine) -> None:
        self.engine = engine
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.task: asyncio.Task | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        # The request keeps its place in the engine until it ends (aborts are not modelled).
        self.transport = None
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self._send(400, _error("malformed HTTP request"), close=True)

    def on_message_begin(self) -> None:
        self.url, self.body = b"", []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        keep = self.parser.should_keep_alive()
        method = self.parser.get_method()
        path = self.url.split(b"?", 1)[0]
        try:
            self._dispatch(method, path, b"".join(self.body), keep)
        except Exception:  # noqa: BLE001 - an emulator bug answers 500, the connection lives on
            log.exception("emulated engine %s: %s %s failed", self.engine.name, method, path)
            self._send(500, _error("emulator error", "InternalServerError", 500), close=not keep)

    def _send(self, status: int, body: bytes, content_type: bytes = b"application/json", close: bool = False) -> None:
        if self.transport is None:
            return
        self.transport.write(b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n%s\r\n%s" % (
            status, b"OK" if status == 200 else b"Error", content_type, len(body),
            b"connection: close\r\n" if close else b"", body))
        if close:
            self.transport.close()

    def _dispatch(self, method: bytes, path: bytes, raw: bytes, keep: bool) -> None:
        engine, close = self.engine, not keep
        if method == b"POST" and path in (b"/v1/chat/completions", b"/v1/completions"):
            self._generate(path == b"/v1/chat/completions", raw, keep)
        elif path == b"/health":
            self._send(200, b"", close=close)
        elif path == b"/metrics":
            self._send(200, engine.metrics(), b"text/plain; version=0.0.4", close=close)
        elif path == b"/v1/models":
            cfg = engine.fleet.config
            self._send(200, _encode({"object": "list", "data": [{
                "id": cfg.model, "object": "model", "created": int(engine.fleet.started_at), "owned_by": "vllm",
                "root": cfg.model, "parent": None, "max_model_len": 8192}]}), close=close)
        elif path == b"/weight_info":
            self._send(200, b'{"weight_version":"default"}', close=close)
        elif method == b"POST" and path == b"/reset_prefix_cache":
            ok = engine.reset_prefix_cache()
            self._send(200, _encode({"success": ok}), close=close)
        else:
            self._send(404, _error(f"no route {path.decode(errors='replace')} on an emulated engine",
                                   "NotFoundError", 404), close=close)

    def _generate(self, chat: bool, raw: bytes, keep: bool) -> None:
        engine = self.engine
        try:
            body = _decode(raw)
            if not isinstance(body, dict):
                raise ValueError("the request body must be a JSON object")
            model = body.get("model") or engine.fleet.config.model
            if model != engine.fleet.config.model:
                self._send(404, _error(f"The model `{model}` does not exist.", "NotFoundError", 404), close=not keep)
                return
            tokens, packed = engine.fleet.prompt(chat, body)
            n = body.get("max_completion_tokens") or body.get("max_tokens") or engine.fleet.config.default_max_tokens
            if not isinstance(n, int) or n < 1:
                raise ValueError("max_tokens must be a positive integer")
        except (msgspec.DecodeError, ValueError, TypeError, KeyError) as exc:
            self._send(400, _error(str(exc)), close=not keep)
            return
        done = engine.submit(tokens, packed, n)
        options = body.get("stream_options") or {}
        run = self._stream(chat, model, done, bool(options.get("include_usage")), keep) if body.get("stream") \
            else self._unary(chat, model, done, keep)
        self.task = asyncio.get_running_loop().create_task(run)

    def _usage(self, done: _Completion) -> dict:
        req, bs = done.req, self.engine.config.block_size
        return {"prompt_tokens": req.n_prompt, "completion_tokens": req.n_out, "total_tokens": req.n_prompt + req.n_out,
                "prompt_tokens_details": {"cached_tokens": req.cached_blocks * bs}}

    async def _unary(self, chat: bool, model: str, done: _Completion, keep: bool) -> None:
        await done.done
        text = _TOKEN_TEXT * done.req.n_out
        choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                  if chat else {"index": 0, "text": text, "finish_reason": "length"})
        self._send(200, _encode({"id": f"cmpl-{self.engine.name}-{done.req.id}",
                                 "object": "chat.completion" if chat else "text_completion",
                                 "created": int(time.time()), "model": model, "choices": [choice],
                                 "usage": self._usage(done)}), close=not keep)
        self.task = None

    async def _stream(self, chat: bool, model: str, done: _Completion, include_usage: bool, keep: bool) -> None:
        """Tokens as SSE events: the first when the engine's prefill step ends, the others one
        decode step apart until the request is done; whatever is left goes out then."""
        t = self.transport
        if t is None:
            return
        t.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
                + (b"" if keep else b"connection: close\r\n") + b"\r\n")
        head = b'{"id":"cmpl-%s-%d","object":"%s","created":%d,"model":%s,"choices":' % (
            self.engine.name.encode(), done.req.id, b"chat.completion.chunk" if chat else b"text_completion",
            int(time.time()), _encode(model))
        token = _encode(_TOKEN_TEXT)
        delta = (b'[{"index":0,"delta":{"content":%s},"finish_reason":%%s}]}' % token if chat
                 else b'[{"index":0,"text":%s,"finish_reason":%%s}]}' % token)
        await done.first
        if chat:
            self._event(head + b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]}')
        n, sent = done.req.n_out, 0
        while sent < n - 1 and not done.done.done():
            self._event(head + delta % b"null")
            sent += 1
            await asyncio.sleep(self.engine.token_interval())
        await done.done
        while sent < n:
            sent += 1
            self._event(head + delta % (b'"length"' if sent == n else b"null"))
        if include_usage:
            self._event(head + b"[],\"usage\":" + _encode(self._usage(done)) + b"}")
        if self.transport is not None:
            self.transport.write(b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n")
            if not keep:
                self.transport.close()
        self.task = None

    def _event(self, payload: bytes) -> None:
        if self.transport is None:
            raise asyncio.CancelledError  # the client left
        event = b"data: " + payload + b"\n\n"
        self.transport.write(b"%x\r\n%s\r\n" % (len(event), event))


async def serve_emulated_fleet(config: EmulatorConfig, ready: Callable[[EmulatedFleet], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    """Run the fleet until `stop` is set (or SIGINT/SIGTERM when none is given)."""
    import signal

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    async with EmulatedFleet(config) as fleet:
        if ready is not None:
            ready(fleet)
        await stop.wait()
