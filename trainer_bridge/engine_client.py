"""The trainer's synchronous client for one engine: vLLM's `VLLMWeightSyncClient` protocol (the
four weight-sync calls, which block while the engine pulls a stream) plus version, reload and
probes, for `push()` and scripts. Rollouts drive engines with the async
`serving.engine_control.EngineControl`; both read engine errors and probes the same way.
"""

from __future__ import annotations

from typing import Any, Literal

import httpx
import torch

from yieldgate.serving import backend_in, dtype_in, is_refusal, tls_context
from .errors import EngineRequestError, PushRefused

__all__ = ["EngineClient", "tls_context"]


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
            if is_refusal(resp.text):
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
        return backend_in(resp.text)

    def model_dtype(self) -> torch.dtype | None:
        """The dtype the engine serves in (vLLM on CPU defaults fp32 checkpoints to bf16)."""
        try:
            text = self._server_config()
        except (httpx.HTTPError, ValueError):
            return None
        name = dtype_in(text)
        dtype = getattr(torch, name, None) if name else None
        return dtype if isinstance(dtype, torch.dtype) else None
