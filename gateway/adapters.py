"""LoRA adapters over HTTP: the admin API (/admin/adapters, admin credential) and how an adapter
shows in /v1/models. The registry and placement are serving/adapters.py; the request path binds a
request to an adapter version in gateway/exchange.py. See docs/adapters.md."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
from fastapi import APIRouter, Depends, Request
from msgspec import Meta
from starlette.responses import Response

from yieldgate.serving import AdapterError, Adapters

from .errors import APIError
from .http import decode_body, json_response
from .schemas import ModelCard

_Text = Annotated[str, Meta(min_length=1, max_length=64)]


class OnDemand(msgspec.Struct, forbid_unknown_fields=True):
    """On at most `replicas` replicas, loaded where a request finds none."""

    replicas: Annotated[int, Meta(ge=1, le=4096)]


class AdapterPush(msgspec.Struct, forbid_unknown_fields=True):
    """POST /admin/adapters: a new adapter, or a new version of one."""

    name: _Text
    version: _Text
    path: Annotated[str, Meta(min_length=1, max_length=4096)]   # a PEFT directory the engines can read
    source: Literal["path"] = "path"
    tiers: list[str] | None = None        # default: every tier (a new version keeps the adapter's)
    placement: Literal["all"] | OnDemand = "all"   # every replica of the tiers, or N on demand
    canary: Annotated[float, Meta(gt=0, lt=1)] | None = None  # that share of requests first (docs/adapters.md#canary)


class AdapterCard(ModelCard):
    """An adapter in /v1/models, as vLLM lists one: `parent` is its base model."""

    parent: str = ""
    root: str = ""


def adapter_cards(adapters: Adapters) -> list[AdapterCard]:
    registry = adapters.adapters
    return [AdapterCard(id=n, parent=registry[n].base, root=f"{n}@{registry[n].current}")
            for n in adapters.names()]


def adapter_api_error(exc: AdapterError) -> APIError:
    return APIError(exc.message, status=exc.status, code=exc.code)


def build_adapters_router(adapters: Adapters, admin: Callable[[Request], None]) -> APIRouter:
    router = APIRouter(prefix="/admin/adapters", dependencies=[Depends(admin)])

    @router.get("")
    async def list_adapters() -> Response:
        return json_response({"object": "list", "data": await adapters.status()})

    @router.post("")
    async def push(request: Request) -> Response:
        spec: AdapterPush = await decode_body(request, AdapterPush)
        try:
            replicas = spec.placement.replicas if isinstance(spec.placement, OnDemand) else 0
            await adapters.push(spec.name, spec.version, spec.path, spec.tiers, replicas, spec.canary)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response(await adapter_doc(adapters, spec.name), 201)

    @router.post("/{name}/rollback")
    async def rollback(name: str) -> Response:
        try:
            await adapters.rollback(name)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response(await adapter_doc(adapters, name))

    @router.delete("/{name}")
    async def remove(name: str) -> Response:
        try:
            await adapters.remove(name)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response({"name": name, "deleted": True})

    return router


async def adapter_doc(adapters: Adapters, name: str) -> dict:
    return next(d for d in await adapters.status() if d["name"] == name)
