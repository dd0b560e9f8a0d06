"""PUT /admin/adapters/{name}/versions/{version}: an adapter version pushed by a trainer
(`trainer_bridge.push_adapter`), the `push` source of an adapter. The body is one safetensors
file with its PEFT config in the metadata (serving/peft.py), `X-Yieldgate-Sha256` its checksum.
The gateway checks the checksum and every shape against the base model before any engine sees
it, keeps it as a PEFT directory under its home (content-addressed, so a version's files never
change under an engine) and places it like a `path` push. Refused: nothing changes."""

from __future__ import annotations

import hashlib
import json
import shutil
from functools import cache
from pathlib import Path
from collections.abc import Callable

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from yieldgate.serving import (
    AdapterError, Adapters, FleetConfig, IncompatibleAdapter, InvalidAdapter, check_packed_adapter,
    home_dir, unpack_adapter,
)

from .adapters import adapter_api_error, adapter_doc
from .errors import APIError, InvalidRequest
from .http import json_response, read_body

MAX_ADAPTER_BYTES = 2 << 30
CHECKSUM_HEADER = "x-yieldgate-sha256"


class UnprocessableAdapter(APIError):
    status = 422
    code = "incompatible_adapter"


def _share(raw: str | None) -> float | None:
    if raw is None:
        return None
    try:
        share = float(raw)
    except ValueError:
        share = -1.0
    if not 0 < share < 1:
        raise InvalidRequest(f"canary must be a share of traffic between 0 and 1 (exclusive), not {raw!r}.",
                             param="canary", code="invalid_value")
    return share


def build_adapter_push_router(adapters: Adapters, fleet: FleetConfig, model_dir: Callable[[], str],
                              admin: Callable[[Request], None]) -> APIRouter:
    """`model_dir()`: the base model's directory, whose config an adapter must fit."""
    router = APIRouter(prefix="/admin/adapters", dependencies=[Depends(admin)])

    @cache
    def model_config() -> dict:
        return json.loads((Path(model_dir()) / "config.json").read_text())

    @router.put("/{name}/versions/{version}")
    async def push(name: str, version: str, request: Request) -> Response:
        expected = (request.headers.get(CHECKSUM_HEADER) or "").strip().lower()
        if len(expected) != 64:
            raise InvalidRequest(f"Send the upload's SHA-256 (64 hex digits) in {CHECKSUM_HEADER}.",
                                 param=CHECKSUM_HEADER, code="missing_checksum")
        tiers = request.query_params.getlist("tiers") or None
        share = _share(request.query_params.get("canary"))
        data = await read_body(request, MAX_ADAPTER_BYTES, f"An adapter upload is at most {MAX_ADAPTER_BYTES} bytes.")
        digest = hashlib.sha256(data).hexdigest()
        if digest != expected:
            raise InvalidRequest(f"Checksum mismatch: the upload's SHA-256 is {digest}, {CHECKSUM_HEADER} "
                                 f"says {expected}; nothing was changed.", param=CHECKSUM_HEADER,
                                 code="checksum_mismatch")
        try:
            config = check_packed_adapter(data, model_config(), fleet.lora.max_rank)
        except IncompatibleAdapter as exc:
            raise UnprocessableAdapter(f"The adapter does not fit the fleet: {exc}.") from None
        except InvalidAdapter as exc:
            raise InvalidRequest(f"Not a LoRA adapter in PEFT form: {exc}.", code="invalid_adapter") from None
        out = home_dir() / "adapters" / f"sha256-{digest[:32]}"
        created = not out.exists()
        if created:
            unpack_adapter(data, config, out.with_name(out.name + ".part")).rename(out)
        try:
            await adapters.push(name, version, str(out), tiers, canary=share)
        except AdapterError as exc:
            if created:
                shutil.rmtree(out, ignore_errors=True)
            raise adapter_api_error(exc) from None
        return json_response(await adapter_doc(adapters, name), 201)

    return router
