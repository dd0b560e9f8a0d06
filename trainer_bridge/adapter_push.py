"""Push a LoRA adapter from a trainer into the fleet behind a gateway: one checksummed upload.

    push_adapter(peft_model, name="support-bot", version="step-100", gateway=URL, token=ADMIN)

The adapter goes as one safetensors file with its PEFT config in the metadata
(serving/peft.py) and its SHA-256 in a header; the gateway checks both and every shape against
the base model, stores it as a PEFT directory and loads it on the placed replicas, then answers.
Adapters are small (a rank-8 adapter of an 8B model's attention is ~30 MB), so one request beats
the chunked stream full weights need.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Mapping
from urllib.parse import quote

import httpx
import msgspec
import torch

from yieldgate.serving import pack_adapter
from .engine_client import tls_context
from .errors import AdapterPushRefused

# PEFT names a module's adapter inside the key ("lora_A.default.weight") in a model's own
# state_dict; the saved and served form has no adapter name.
_ADAPTER_NAME = re.compile(r"\.lora_([AB])\.[^.]+\.weight$")


class AdapterPushReport(msgspec.Struct):
    name: str
    version: str
    bytes: int
    sha256: str
    seconds: float
    adapter: dict                # the gateway's GET /admin/adapters entry for it after the push


def adapter_state(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], *,
                  alpha: float | None = None) -> tuple[dict[str, torch.Tensor], int, float]:
    """-> (PEFT key -> tensor, rank, alpha) from a PEFT model or a state dict of LoRA tensors.
    A PEFT model brings its own rank and alpha; for a state dict the rank is lora_A's first
    dimension and alpha defaults to the rank (scale 1)."""
    config = None
    if isinstance(model_or_state_dict, torch.nn.Module):
        peft_config = getattr(model_or_state_dict, "peft_config", None)
        if peft_config:
            config = next(iter(peft_config.values()))
        state = model_or_state_dict.state_dict()
    else:
        state = dict(model_or_state_dict)
    tensors = {_peft_key(k): v for k, v in state.items() if ".lora_" in k}
    if not tensors:
        raise ValueError("no LoRA tensors (keys with lora_A / lora_B) in the model or state dict")
    if config is not None:
        return tensors, int(config.r), float(alpha if alpha is not None else config.lora_alpha)
    rank = next(v.shape[0] for k, v in tensors.items() if ".lora_A." in k)
    return tensors, rank, float(alpha if alpha is not None else rank)


def _peft_key(key: str) -> str:
    key = _ADAPTER_NAME.sub(r".lora_\1.weight", key)
    # A LoRA written into a plain transformers model names its modules from "model.layers".
    return "base_model.model." + key if key.startswith("model.layers.") else key


def push_adapter(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    *,
    name: str,
    version: str,
    gateway: str,
    token: str | None = None,
    alpha: float | None = None,
    tiers: list[str] | None = None,
    canary: float | None = None,
    timeout_s: float = 300.0,
) -> AdapterPushReport:
    """Upload one adapter version; answers once the placed replicas serve it (or, with `canary`,
    once that share of the adapter's traffic goes to it). `token` is the gateway's admin token.
    Raises AdapterPushRefused with the gateway's status and message if it refused the version."""
    tensors, rank, alpha = adapter_state(model_or_state_dict, alpha=alpha)
    started = time.perf_counter()
    data = pack_adapter(tensors, rank, alpha)
    digest = hashlib.sha256(data).hexdigest()
    params: list[tuple[str, str]] = [("tiers", t) for t in tiers or []]
    if canary is not None:
        params.append(("canary", str(canary)))
    headers = {"Content-Type": "application/octet-stream", "X-Yieldgate-Sha256": digest}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    url = f"{gateway.rstrip('/')}/admin/adapters/{quote(name, safe='')}/versions/{quote(version, safe='')}"
    resp = httpx.put(url, content=data, params=params, headers=headers, timeout=timeout_s, verify=tls_context())
    if resp.status_code != 201:
        try:
            error = resp.json()["error"]
            code, message = error.get("code"), error.get("message", resp.text)
        except (ValueError, KeyError, TypeError):
            code, message = None, resp.text[:500]
        raise AdapterPushRefused(resp.status_code, code, message)
    return AdapterPushReport(name, version, len(data), digest, time.perf_counter() - started, resp.json())
