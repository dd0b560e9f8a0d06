"""The trainer-facing API: push weights from any PyTorch loop into running vLLM engines.

    push(model, version="step-100", engines=["http://127.0.0.1:8101"], token=TOKEN)

For each engine: arm (`/init_weight_transfer_engine` with the push token), `/start_weight_update`,
`/update_weights` (blocks while the engine pulls chunks from our chunk server), then
`/finish_weight_update` with the version and `/reset_prefix_cache` (KV computed by the old weights
must not be reused). Engines are served in parallel from one serialization of the weights.

Through a gateway (`gateway=URL`): one announce (`POST /admin/weights/push` with the stream
description; the gateway starts every receiver pulling), the stream, one finish that answers
when the gateway's rollout ended.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import torch

from .config import BridgeConfig
from .engine_client import EngineClient, tls_context
from .errors import BridgeError, EngineRequestError, PushFailed, PushRefused
from .sender import ChunkSender, StreamTarget
from .weights import WeightSet

ModelLike = torch.nn.Module | Mapping[str, torch.Tensor] | WeightSet


class PushReport(msgspec.Struct):
    version: str
    engines: list[str]
    tensors: int
    bytes_per_engine: int
    seconds: float
    transfer_seconds: float  # /update_weights round: stream + verify + load_weights
    transports: dict[str, str] = {}  # engine URL -> "shm" (same host, in place) | "tcp"

    @property
    def gb_per_s(self) -> float:
        """Payload delivered (all engines) per second of transfer."""
        total = self.bytes_per_engine * len(self.engines)
        return total / self.transfer_seconds / 1e9 if self.transfer_seconds else 0.0


class PushFaults(msgspec.Struct, frozen=True, kw_only=True):
    """Faults a test injects into a push: chunk `corrupt_chunk` gets one byte flipped after it
    was checksummed, sent after `delay_s` (so an engine loads what came before it first), to
    the target URLs `only` accepts (None: every target)."""

    corrupt_chunk: int | None = None
    delay_s: float = 0.0
    only: Callable[[str], bool] | None = None

    def stream_target(self, url: str, token: str, session: bytes | None = None) -> StreamTarget:
        hit = self.only is None or self.only(url)
        target = StreamTarget(token=token, corrupt_chunk=self.corrupt_chunk if hit else None,
                              corrupt_delay_s=self.delay_s)
        if session is not None:
            target.session = session
        return target


class _Streamed(msgspec.Struct):
    """What `_stream` did, per engine URL."""

    failures: dict[str, BaseException]
    transfer_seconds: float
    sessions: dict[str, str]  # session hex, for the engines that did not fail
    transports: dict[str, str]


def _weights(model: ModelLike, dtype: torch.dtype | None) -> WeightSet:
    if isinstance(model, WeightSet):
        return model
    return WeightSet.from_model(model, dtype=dtype)


def resolve_gateway_engines(
    gateway: str, admin_token: str | None, mode: str = "rolling", version: str | None = None
) -> tuple[list[str], str | None, torch.dtype | None]:
    """Ask the gateway which engines take pushes, which push token is current and which dtype
    the fleet serves (saves the trainer a /server_info round trip). push(gateway=URL) asks this
    only for the dtype, when it was not given; it announces the push itself in one call.

    Contract (gateway side): `GET /admin/weight_targets?mode=rolling|all_at_once[&version=V]` ->
    {"engines": [url...], "push_token": str, "dtype": "bfloat16" | null}. With the version
    named up front, a rolling update starts as soon as every engine is staging.
    """
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    params = {"mode": mode, **({"version": version} if version else {})}
    resp = httpx.get(gateway.rstrip("/") + "/admin/weight_targets", headers=headers, timeout=30.0,
                     params=params, verify=tls_context())
    resp.raise_for_status()
    body = resp.json()
    dtype = getattr(torch, str(body.get("dtype") or ""), None)
    return (list(body["engines"]), body.get("push_token"),
            dtype if isinstance(dtype, torch.dtype) else None)


def push(
    model_or_state_dict: ModelLike,
    version: str,
    engines: Sequence[str] | None = None,
    gateway: str | None = None,
    token: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
    init: bool = True,
    config: BridgeConfig | None = None,
    faults: PushFaults | None = None,
    draft: bool = False,
    mode: str = "rolling",
) -> PushReport:
    """Push weights to every engine (or every engine the gateway lists); all-or-raise.

    `mode` (through a gateway): how the gateway swaps the pushed weights in, "rolling" (one
    wave of replicas at a time, the others serve) or "all_at_once" (every replica drains
    together while the gateway holds new requests; one drain instead of one per wave).

    `draft=True` pushes into each engine's speculative-decoding draft model instead (vLLM's
    /start_draft_weight_update session; engines only, not through the gateway): the served
    outputs stay the target model's, only the acceptance rate moves.

    `dtype`: wire/staging dtype; default is the first engine's serving dtype (vLLM on CPU serves
    fp32 checkpoints as bf16, so that halves the bytes). `init=False` skips arming the engine
    (it must already hold `token`). `faults` corrupts a chunk on purpose (tests).
    Raises PushFailed (with per-engine causes) if any engine did not take the update; those
    engines keep serving their previous weights and version.
    """
    cfg = config or BridgeConfig()
    if draft and gateway is not None:
        raise ValueError("draft pushes go to engines directly (engines=[...]); the gateway "
                         "rolls out served models only")
    if gateway is not None and not engines:
        if dtype is None and not isinstance(model_or_state_dict, WeightSet):
            # The announce describes the stream, so the dtype is needed first (one more round
            # trip; pass dtype= to save it). The intake this opens is taken up by the announce.
            dtype = resolve_gateway_engines(gateway, token, mode, version)[2]
        return _push_through_gateway(_weights(model_or_state_dict, dtype), version, gateway,
                                     token, mode, cfg, progress, faults or PushFaults())
    if gateway is not None:
        listed, gateway_token, served_dtype = resolve_gateway_engines(gateway, token, mode, version)
        engines = list(engines or []) + listed
        token = gateway_token or token
        dtype = dtype or served_dtype
    if not engines:
        raise ValueError("push needs engines=[...] or gateway=URL")
    token = token or secrets.token_hex(16)
    clients = [EngineClient(url, cfg.http_timeout_s) for url in engines]
    try:
        if dtype is None and not isinstance(model_or_state_dict, WeightSet):
            dtype = clients[0].model_dtype()
        weights = _weights(model_or_state_dict, dtype)
        return _push(weights, version, clients, token, cfg, progress, init, faults or PushFaults(),
                     draft)
    finally:
        for c in clients:
            c.close()


def _push(
    weights: WeightSet,
    version: str,
    clients: list[EngineClient],
    token: str,
    cfg: BridgeConfig,
    progress: bool,
    init: bool,
    faults: PushFaults,
    draft: bool = False,
) -> PushReport:
    started = time.perf_counter()

    def finish(client: EngineClient) -> None:
        # Each engine commits as soon as its own update is in, not after the slowest one (through
        # a gateway: its rollout starts once the engines staged, not after the checkpoint copy).
        client.finish_weight_update(version)
        client.reset_prefix_cache()

    with ThreadPoolExecutor(max_workers=max(2, 2 * len(clients))) as pool:
        streamed = _stream(pool, weights, clients, token, cfg, phase="load", init=init,
                           progress=progress, label=version, faults=faults, draft=draft, then=finish)

    if streamed.failures:
        raise PushFailed(streamed.failures)
    return PushReport(
        version=version,
        engines=[c.base_url for c in clients],
        tensors=len(weights.entries),
        bytes_per_engine=weights.total_bytes,
        seconds=time.perf_counter() - started,
        transfer_seconds=streamed.transfer_seconds,
        transports=streamed.transports,
    )


def _push_through_gateway(
    weights: WeightSet,
    version: str,
    gateway: str,
    admin_token: str | None,
    mode: str,
    cfg: BridgeConfig,
    progress: bool,
    faults: PushFaults,
) -> PushReport:
    """One announce (`POST /admin/weights/push`: the gateway opens the push, starts every engine
    staging from our chunk server and its own copy receiving), the stream, one finish (answers
    once the rollout ended). The engines dial the chunk server before we know their sessions:
    their connections wait in its listen backlog until `stream` accepts them."""
    started = time.perf_counter()
    base = gateway.rstrip("/")
    headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
    failures: dict[str, BaseException] = {}
    with ChunkSender(
        cfg.bind_host, cfg.advertise_host, cfg.chunk_bytes, cfg.checksum, cfg.connect_timeout_s,
        cfg.shared_memory,
    ) as sender, httpx.Client(timeout=cfg.http_timeout_s, headers=headers,
                              verify=tls_context()) as http:
        stream = {**weights.metadata(), "sender": sender.address, "checksum": cfg.checksum,
                  "timeout_s": cfg.stream_timeout_s,
                  **({} if cfg.pipeline_load else {"extra": {"pipeline": False}})}
        resp = http.post(base + "/admin/weights/push",
                         json={"version": version, "mode": mode, "stream": stream})
        if resp.status_code >= 400:
            raise PushFailed({base: _gateway_error(base + "/admin/weights/push", resp)})
        body = resp.json()
        targets = {t["url"]: faults.stream_target(t["url"], body["push_token"],
                                                  bytes.fromhex(t["session"]))
                   for t in body["targets"]}
        bar = _Progress(weights.total_bytes * len(targets), version, progress)
        transfer_started = time.perf_counter()
        sender.stream(weights, list(targets.values()), bar.callback)
        transfer_seconds = time.perf_counter() - transfer_started
        bar.close()
        failures = {url: t.error for url, t in targets.items() if t.error is not None}
        if len(failures) < len(targets):
            # Some receivers verified their stream: the gateway decides (a rolling update named
            # up front is running already; a failed engine fails its apply and restores N-1).
            done = http.post(body["finish"], json={"weight_version": version})
            if done.status_code >= 400:
                error = _gateway_error(body["finish"], done)
                failures.update({url: error for url in targets if url not in failures})
    if failures:
        raise PushFailed(failures)
    return PushReport(
        version=version,
        engines=list(targets),
        tensors=len(weights.entries),
        bytes_per_engine=weights.total_bytes,
        seconds=time.perf_counter() - started,
        transfer_seconds=transfer_seconds,
        transports={url: t.transport for url, t in targets.items() if t.transport},
    )


def _gateway_error(url: str, resp: httpx.Response) -> BridgeError:
    """The gateway's answer as the error an engine would have raised (refusals stay refusals)."""
    if resp.status_code in (401, 403) or "push_refused" in resp.text:
        return PushRefused(f"{url}: {resp.text[:300]}")
    return EngineRequestError(url, resp.status_code, resp.text)


class _Progress:
    """A byte progress bar that several writer threads (one per receiver) tick; None = off."""

    def __init__(self, total: int, label: str, show: bool) -> None:
        self.bar = _progress_bar(total, label) if show else None
        self.lock = threading.Lock()

    def tick(self, n: int) -> None:
        with self.lock:
            self.bar.update(n)

    @property
    def callback(self) -> Callable[[int], None] | None:
        return self.tick if self.bar is not None else None

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _stream(
    pool: ThreadPoolExecutor,
    weights: WeightSet,
    clients: list[EngineClient],
    token: str,
    cfg: BridgeConfig,
    *,
    phase: str,
    init: bool,
    progress: bool = False,
    label: str = "",
    faults: PushFaults = PushFaults(),
    draft: bool = False,
    then: Callable[[EngineClient], None] | None = None,
) -> _Streamed:
    """Arm (if `init`), start and stream one serialization of `weights` to every engine.

    With phase "load" each engine has loaded the weights when this returns; with "stage" each
    holds them verified in its staging buffers, to be loaded by `apply_staged`. `then(client)`
    runs as soon as that engine's update returned and its stream ended verified (a failure in
    it counts as the engine's); transfer seconds end there for the last engine, before its `then`."""
    failures = _open_sessions(pool, clients, token, init, draft)
    live = [c for c in clients if c.base_url not in failures]
    transfer_started = time.perf_counter()
    updated: list[float] = []  # when each engine's update ended verified
    with ChunkSender(
        cfg.bind_host, cfg.advertise_host, cfg.chunk_bytes, cfg.checksum, cfg.connect_timeout_s,
        cfg.shared_memory,
    ) as sender:
        targets = {c.base_url: faults.stream_target(c.base_url, token) for c in live}

        def update(client: EngineClient) -> None:
            _update_one(sender, weights, client, targets[client.base_url], cfg, phase)
            updated.append(time.perf_counter())
            if then is not None:
                then(client)

        bar = _Progress(weights.total_bytes * len(live), label, progress)
        updates = {c.base_url: pool.submit(update, c) for c in live}
        sender.stream(weights, list(targets.values()), bar.callback)
        for url, fut in updates.items():
            error = _outcome(fut, targets[url])
            if error is not None:
                failures[url] = error
        bar.close()
    return _Streamed(
        failures=failures,
        transfer_seconds=max(updated, default=time.perf_counter()) - transfer_started,
        sessions={url: t.session.hex() for url, t in targets.items() if url not in failures},
        transports={url: t.transport for url, t in targets.items() if t.transport},
    )


def _open_sessions(pool: ThreadPoolExecutor, clients: list[EngineClient], token: str, init: bool,
                   draft: bool) -> dict[str, BaseException]:
    """Arm (if `init`) and start an update session on every engine. -> failures per engine."""
    def prepare(client: EngineClient) -> None:
        if init:
            client.init_weight_transfer_engine({"token": token})
        (client.start_draft_weight_update if draft else client.start_weight_update)()

    failures: dict[str, BaseException] = {}
    for client, fut in [(c, pool.submit(prepare, c)) for c in clients]:
        try:
            fut.result()
        except Exception as exc:  # noqa: BLE001 - reported per engine
            failures[client.base_url] = exc
    return failures


def _update_one(sender: ChunkSender, weights: WeightSet, client: EngineClient, target: StreamTarget,
                cfg: BridgeConfig, phase: str) -> None:
    """One engine's /update_weights (it pulls `target`'s stream); returns once its stream ended
    verified, raises the stream's or the engine's reason otherwise."""
    try:
        info = sender.update_info(weights, target, cfg.stream_timeout_s)
        extra = {} if cfg.pipeline_load else {"extra": {"pipeline": False}}
        client.update_weights({**info, "phase": phase, **extra})
    except Exception as exc:
        target.done.wait(1.0)  # let the writer record the stream-side reason first
        target.fail(exc)
        raise
    # A staging engine answers at once and verifies in the background: its stream is over
    # (status received) only once the writer is done.
    target.done.wait(cfg.stream_timeout_s)
    if target.error is not None:
        raise target.error


def _outcome(fut: Future, target: StreamTarget) -> BaseException | None:
    """Why one engine's update failed (the stream's reason first), or None."""
    try:
        fut.result()
    except BaseException as exc:  # noqa: BLE001
        stream_error = target.error
        if stream_error is not None and stream_error is not exc:
            # The stream says why it broke; the engine's answer says what it did about it.
            stream_error.add_note(f"engine answered: {exc}")
        return stream_error or exc
    return target.error


def stage(
    weights: WeightSet, engines: Sequence[str], token: str, config: BridgeConfig | None = None
) -> tuple[dict[str, str], float]:
    """Stream `weights` into every engine's staging buffers, verified but not loaded: the
    engines keep serving their current weights meanwhile. -> (session per engine, seconds).
    Raises PushFailed (and drops what the other engines staged) if any engine failed."""
    cfg = config or BridgeConfig()
    clients = [EngineClient(url, cfg.http_timeout_s) for url in engines]
    try:
        with ThreadPoolExecutor(max_workers=max(2, 2 * len(clients))) as pool:
            streamed = _stream(pool, weights, clients, token, cfg, phase="stage", init=False)
            if streamed.failures:
                for client in clients:
                    try:
                        client.finish_weight_update()  # ends the session; the engine drops staging
                    except Exception:  # noqa: BLE001 - best effort; a later start drops it too
                        pass
                raise PushFailed(streamed.failures)
        return streamed.sessions, streamed.transfer_seconds
    finally:
        for c in clients:
            c.close()


def apply_staged(
    engine_url: str, session: str, version: str, config: BridgeConfig | None = None
) -> None:
    """Load what `stage` left in the engine, commit `version`, reset the prefix cache (KV from
    the old weights must not be reused). The engine must not be serving meanwhile."""
    cfg = config or BridgeConfig()
    with EngineClient(engine_url, cfg.http_timeout_s) as client:
        client.update_weights(
            {"names": [], "dtype_names": [], "shapes": [], "session": session, "phase": "apply",
             "timeout_s": cfg.stream_timeout_s}
        )
        # Independent once the weights are in (the engine is drained): one round trip, not two.
        with ThreadPoolExecutor(1) as pool:
            reset = pool.submit(client.reset_prefix_cache)
            client.finish_weight_update(version)
            reset.result()


def discard_staged(engine_url: str) -> None:
    """End the engine's update session without loading anything it staged."""
    with EngineClient(engine_url, 60.0) as client:
        client.finish_weight_update()


def _progress_bar(total: int, version: str):
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"push {version}")


def push_to_engine(
    engine_url: str,
    state_dict: ModelLike,
    version: str,
    token: str | None = None,
    *,
    dtype: torch.dtype | None = None,
    init: bool = True,
    progress: bool = False,
    config: BridgeConfig | None = None,
    faults: PushFaults | None = None,
) -> PushReport:
    """One engine: arm, start, stream + verify + load, finish(version), reset prefix cache."""
    try:
        return push(
            state_dict, version, [engine_url], token=token, dtype=dtype, progress=progress,
            init=init, config=config, faults=faults,
        )
    except PushFailed as exc:
        # One engine: surface its own cause (PushRefused, ChecksumMismatch, ...) directly.
        cause = exc.failures.get(engine_url.rstrip("/"))
        if isinstance(cause, BridgeError):
            raise cause from exc
        raise


def reload_from_checkpoint(
    engine_url: str, path: str | Path, version: str | None = None, timeout_s: float = 600.0
) -> None:
    """Fallback for engines without the plugin: vLLM reloads an HF directory in place.
    Sets the version if given, then resets the prefix cache."""
    with EngineClient(engine_url, timeout_s) as client:
        client.reload_weights(str(Path(path).resolve()))
        if version is not None:
            client.set_weight_version(version)
        client.reset_prefix_cache()


def engine_weight_version(engine_url: str) -> str:
    """The engine's committed weight version (`GET /weight_info`); "default" before any push."""
    with EngineClient(engine_url, 30.0) as client:
        return client.weight_version()


def make_push_token() -> str:
    return secrets.token_urlsafe(24)


def arm_engine(engine_url: str, token: str, current_token: str | None = None) -> None:
    """Give an engine the push token for this rollout (rotating needs the current token)."""
    info: dict[str, str] = {"token": token}
    if current_token is not None:
        info["current_token"] = current_token
    with EngineClient(engine_url, 60.0) as client:
        client.init_weight_transfer_engine(info)


ProgressCallback = Callable[[int], None]
