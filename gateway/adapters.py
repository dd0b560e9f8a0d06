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

from .errors import APIError, InvalidRequest
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
    model: str = ""                       # the base model it adapts (docs/models.md#many-models); "" = the first


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


def build_adapters_router(models: dict[str, Adapters], admin: Callable[[Request], None]) -> APIRouter:
    """`models`: each base model's adapters (gateway/registry.py), the first model's first. An
    adapter belongs to one base model; its name is unique across them."""
    router = APIRouter(prefix="/admin/adapters", dependencies=[Depends(admin)])
    first = next(iter(models.values()))

    def holder(name: str) -> Adapters:
        """The adapters of the model that has adapter `name` (the first model's if none has)."""
        return next((a for a in models.values() if name in a.adapters), first)

    @router.get("")
    async def list_adapters() -> Response:
        return json_response({"object": "list", "data": [d for a in models.values() for d in await a.status()]})

    @router.post("")
    async def push(request: Request) -> Response:
        spec: AdapterPush = await decode_body(request, AdapterPush)
        adapters = models.get(spec.model) if spec.model else first
        if adapters is None:
            raise InvalidRequest(f"No base model '{spec.model}' in this gateway (one of {', '.join(models)}).",
                                 param="model", code="model_not_found")
        if spec.name in models:
            raise InvalidRequest(f"'{spec.name}' is a base model's name.", param="name")
        other = holder(spec.name)
        if spec.name in other.adapters and other is not adapters:
            raise APIError(f"Adapter '{spec.name}' adapts model '{other.base}'; a name is one adapter's.",
                           status=409, code="adapter_exists")
        try:
            replicas = spec.placement.replicas if isinstance(spec.placement, OnDemand) else 0
            await adapters.push(spec.name, spec.version, spec.path, spec.tiers, replicas, spec.canary)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response(await adapter_doc(adapters, spec.name), 201)

    @router.post("/{name}/rollback")
    async def rollback(name: str) -> Response:
        adapters = holder(name)
        try:
            await adapters.rollback(name)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response(await adapter_doc(adapters, name))

    @router.delete("/{name}")
    async def remove(name: str) -> Response:
        try:
            await holder(name).remove(name)
        except AdapterError as exc:
            raise adapter_api_error(exc) from None
        return json_response({"name": name, "deleted": True})

    return router


async def adapter_doc(adapters: Adapters, name: str) -> dict:
    return next(d for d in await adapters.status() if d["name"] == name)
