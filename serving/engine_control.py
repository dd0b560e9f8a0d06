"""The one async client for a vLLM engine's control plane (dev-mode endpoints,
VLLM_SERVER_DEV_MODE=1): push-token arming, weight-transfer backend, version, update sessions
(stage, apply, discard), checkpoint reload, prefix-cache reset, pause/resume, health.

    async with EngineControl("http://127.0.0.1:8101") as engine:
        await engine.arm(token, current=old_token)
        await engine.apply(session, "step-100")

Every weight rollout, restore and rollback drives engines through this class; the trainer's
synchronous push (`trainer_bridge.EngineClient`) shares its error reading and probes.
"""

from __future__ import annotations

import asyncio
import functools
import re
import ssl
from typing import Any, Literal

import httpx

# Substrings of the engine's error text that mean "token refused", not "transport broke".
REFUSAL_MARKERS = ("push token", "not armed", "already armed")
_BACKEND = re.compile(r"Invalid init_info for (\w+?)WeightTransferEngine")
_DTYPE = re.compile(r"dtype=torch\.(\w+)")


class EngineCallFailed(Exception):
    """An engine control endpoint answered with an error status."""

    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"{url} -> HTTP {status}: {body[:500]}")
        self.url = url
        self.status = status
        self.body = body


class EngineRefused(EngineCallFailed):
    """The engine refused the push token (missing, wrong, or a rotation without the current one)."""

    def __str__(self) -> str:
        return f"{self.url}: {self.body[:300]}"


def is_refusal(text: str) -> bool:
    return any(m in text for m in REFUSAL_MARKERS)


def backend_in(probe_answer: str) -> str | None:
    """The backend named by an engine's answer to an empty init_info (see `transfer_backend`)."""
    match = _BACKEND.search(probe_answer)
    return match.group(1).lower() if match else None


def dtype_in(vllm_config: str) -> str | None:
    """The serving dtype's name ("bfloat16") in /server_info's vllm_config text."""
    match = _DTYPE.search(vllm_config)
    return match.group(1) if match else None


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every engine client. httpx otherwise builds a fresh one (loading the
    CA bundle) per client: ~90 ms of CPU each on a busy 2-core box, and a rollout makes dozens."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class EngineControl:
    """One engine's control plane. `timeout_s` bounds each call; an apply or a reload takes as
    long as loading the weights does, so callers that run them pass a long one."""

    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        # vLLM's server closes a connection idle for 5 s (uvicorn keep-alive); a call on a pooled
        # connection it has just closed fails with ReadError, so idle connections are dropped first.
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, verify=tls_context(),
                                       limits=httpx.Limits(keepalive_expiry=1.0))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> EngineControl:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            resp = await self._http.request(method, path, **kwargs)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # The server closed a kept-alive connection as the call went out (its keep-alive
            # timer and ours raced): sent again once, on a new connection.
            resp = await self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            cls = EngineRefused if is_refusal(resp.text) else EngineCallFailed
            raise cls(self.base_url + path, resp.status_code, resp.text)
        return resp

    # -- push token and backend
    async def arm(self, token: str, current: str | None = None) -> None:
        """Give the engine `token` for later pushes; rotating an armed engine needs `current`."""
        info = {"token": token} if current is None else {"token": token, "current_token": current}
        await self._call("POST", "/init_weight_transfer_engine", json={"init_info": info})

    async def transfer_backend(self) -> str | None:
        """The engine's `--weight-transfer-config` backend, or None if it has none.

        /server_info omits the weight-transfer config, so this probes: an empty init_info fails
        validation before any side effect, and the error names the backend's engine class
        (`Invalid init_info for YieldgateWeightTransferEngine`), or says none is configured."""
        try:
            resp = await self._http.post("/init_weight_transfer_engine", json={"init_info": {}},
                                         timeout=30.0)
        except httpx.HTTPError:
            return None
        return backend_in(resp.text)

    # -- versions and model
    async def weight_version(self) -> str:
        """The committed weight version; vLLM says "default" before any update."""
        return str((await self._call("GET", "/weight_info")).json()["weight_version"])

    async def set_weight_version(self, version: str) -> None:
        await self._call("POST", "/update_weight_version", json={"new_version": version})

    async def server_info(self) -> httpx.Response:
        # The first /server_info of an engine's life collects its system environment (vLLM's
        # collect_env, cached afterwards): seconds, and more than 10 on a busy box.
        return await self._http.get("/server_info", timeout=60.0)

    async def serving_dtype(self) -> str | None:
        """The dtype's name the engine serves in (vLLM on CPU serves fp32 checkpoints as bf16)."""
        try:
            resp = await self.server_info()
            text = str(resp.json().get("vllm_config", "")) if resp.status_code == 200 else ""
        except (httpx.HTTPError, ValueError):
            return None
        return dtype_in(text)

    async def healthy(self) -> bool:
        try:
            return (await self._http.get("/health", timeout=5.0)).status_code == 200
        except httpx.HTTPError:
            return False

    async def complete(self, model: str, prompt: str, max_tokens: int) -> str:
        """A greedy completion straight from the engine ("" if it refuses): a canary's probe."""
        resp = await self._http.post("/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        return str(resp.json()["choices"][0]["text"]) if resp.status_code == 200 else ""

    # -- update sessions: stage while serving, apply on a drained engine
    async def open_session(self) -> None:
        """Start an update session (vLLM refuses /update_weights outside one). One an abandoned
        push left open is ended first: nothing staged in it was ever applied."""
        try:
            await self._call("POST", "/start_weight_update")
        except EngineCallFailed as exc:
            if "already active" not in exc.body:
                raise
            await self.discard()
            await self._call("POST", "/start_weight_update")

    async def stage(self, update_info: dict[str, Any]) -> None:
        """Pull a trainer's chunk stream into the staging buffers, verified in the background
        while the engine serves; `apply` loads it later."""
        await self._call("POST", "/update_weights",
                         json={"update_info": {**update_info, "phase": "stage"}})

    async def apply(self, session: str, version: str, stream_timeout_s: float = 120.0) -> None:
        """Load what `stage` left, commit `version`, reset the prefix cache (KV computed by the
        old weights must not be reused). The engine must not be serving meanwhile."""
        await self._call("POST", "/update_weights", json={"update_info": {
            "names": [], "dtype_names": [], "shapes": [], "session": session, "phase": "apply",
            "timeout_s": stream_timeout_s}})
        # Independent once the weights are in (the engine is drained): one round trip, not two.
        await asyncio.gather(self.reset_prefix_cache(), self.finish(version))

    async def finish(self, version: str | None = None) -> None:
        await self._call("POST", "/finish_weight_update", json={"weight_version": version})

    async def discard(self) -> None:
        """End the update session without loading anything it staged."""
        await self.finish(None)

    async def reload(self, checkpoint_dir: str, version: str | None = None) -> None:
        """Engines without the plugin: vLLM reloads an HF directory in place; then the version
        (if given) and a prefix-cache reset."""
        await self._call("POST", "/collective_rpc", json={
            "method": "reload_weights",
            "kwargs": {"weights_path": checkpoint_dir, "is_checkpoint_format": True}})
        if version is not None:
            await self.set_weight_version(version)
        await self.reset_prefix_cache()

    async def reset_prefix_cache(self) -> bool:
        return bool((await self._call("POST", "/reset_prefix_cache")).json().get("success"))

    # -- serving
    async def pause(self, mode: Literal["wait", "abort", "keep"] = "wait") -> None:
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

