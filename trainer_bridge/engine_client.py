"""HTTP client for one vLLM engine's control plane (dev-mode endpoints, VLLM_SERVER_DEV_MODE=1).

Implements vLLM's `VLLMWeightSyncClient` protocol (the four weight-sync calls) plus the
operational endpoints a rollout needs: pause/resume, prefix-cache reset, version, reload.
"""

from __future__ import annotations

import functools
import re
import ssl
from typing import Any, Literal

import httpx
import torch

from yieldgate.trainer_bridge.errors import EngineRequestError, PushRefused

# Substrings of the engine's error text that mean "token refused", not "transport broke".
_REFUSAL_MARKERS = ("push token", "not armed", "already armed")


@functools.cache
def tls_context() -> ssl.SSLContext:
    """One TLS context for every engine client. httpx otherwise builds a fresh one (loading the
    CA bundle) per client: ~90 ms of CPU each on a busy 2-core box, and a rollout makes dozens."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


class EngineClient:
    def __init__(self, base_url: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout_s, verify=tls_context())

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        resp = self._http.request(method, path, **kwargs)
        if resp.status_code >= 400:
            if any(m in resp.text for m in _REFUSAL_MARKERS):
                raise PushRefused(f"{self.base_url}{path}: {resp.text[:300]}")
            raise EngineRequestError(self.base_url + path, resp.status_code, resp.text)
        return resp

    # --- VLLMWeightSyncClient
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._call("POST", "/init_weight_transfer_engine", json={"init_info": init_info})

    def start_weight_update(self) -> None:
        self._call("POST", "/start_weight_update")

    def start_draft_weight_update(self) -> None:
        """Like start_weight_update, but this session's weights go to the speculative draft model."""
        self._call("POST", "/start_draft_weight_update")

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        self._call("POST", "/update_weights", json={"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._call("POST", "/finish_weight_update", json={"weight_version": weight_version})

    # --- operations
    def weight_version(self) -> str:
        return str(self._call("GET", "/weight_info").json()["weight_version"])

    def set_weight_version(self, version: str) -> None:
        self._call("POST", "/update_weight_version", json={"new_version": version})

    def reset_prefix_cache(self) -> bool:
        return bool(self._call("POST", "/reset_prefix_cache").json().get("success"))

    def pause(self, mode: Literal["wait", "abort", "keep"] = "wait") -> None:
        self._call("POST", "/pause", params={"mode": mode})

    def resume(self) -> None:
        self._call("POST", "/resume")

    def healthy(self) -> bool:
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def reload_weights(self, checkpoint_dir: str) -> None:
        self._call(
            "POST",
            "/collective_rpc",
            json={
                "method": "reload_weights",
                "kwargs": {"weights_path": checkpoint_dir, "is_checkpoint_format": True},
            },
        )

    def _server_config(self) -> str:
        # The first /server_info of an engine's life collects its system environment (vLLM's
        # collect_env, cached afterwards): seconds, and more than 10 on a busy box.
        resp = self._http.get("/server_info", timeout=60.0)
        if resp.status_code != 200:
            return ""
        return str(resp.json().get("vllm_config", ""))

    def transfer_backend(self) -> str | None:
        """The engine's `--weight-transfer-config` backend, or None if it has none.

        /server_info omits the weight-transfer config, so this probes: an empty init_info fails
        validation before any side effect, and the error names the backend's engine class
        (`Invalid init_info for YieldgateWeightTransferEngine`), or says none is configured."""
        try:
            resp = self._http.post("/init_weight_transfer_engine", json={"init_info": {}}, timeout=30.0)
        except httpx.HTTPError:
            return None
        match = re.search(r"Invalid init_info for (\w+?)WeightTransferEngine", resp.text)
        return match.group(1).lower() if match else None

    def model_dtype(self) -> torch.dtype | None:
        """The dtype the engine serves in (vLLM on CPU defaults fp32 checkpoints to bf16)."""
        try:
            text = self._server_config()
        except (httpx.HTTPError, ValueError):
            return None
        match = re.search(r"dtype=torch\.(\w+)", text)
        dtype = getattr(torch, match.group(1), None) if match else None
        return dtype if isinstance(dtype, torch.dtype) else None
