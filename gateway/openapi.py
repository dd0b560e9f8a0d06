"""The gateway's OpenAPI document: FastAPI's for the routes FastAPI serves (admin, models, health,
dashboard), and the inference routes from their schemas. Those are served straight from ASGI
(gateway/app.py GatewayApp), not through FastAPI, so their operations are written here from
gateway/apis.py: each API's path and its request `msgspec.Struct`, whose JSON schema is the body's.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi import FastAPI

from .apis import APIS, Api

_REF = "#/components/schemas/{name}"
_STREAMED = {"chat", "completions", "responses", "messages"}  # `"stream": true` answers as server-sent events


def inference_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """(paths, component schemas) of the inference routes, one POST operation per API."""
    apis = list(APIS.values())
    bodies, components = msgspec.json.schema_components([api.request for api in apis], ref_template=_REF)
    paths = {api.path: {"post": _operation(api, body)} for api, body in zip(apis, bodies)}
    return paths, components


def _operation(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    answer: dict[str, Any] = {"application/json": {"schema": {}}}
    if api.name in _STREAMED:
        answer["text/event-stream"] = {"schema": {"type": "string"}}
    doc = (api.__doc__ or "").split("\n\n")[0]
    return {
        "summary": api.path.removeprefix("/v1/").replace("/", " ").replace("_", " ").title(),
        "description": " ".join(doc.split()),
        "operationId": f"{api.name}_{api.path.strip('/').replace('/', '_')}_post",
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "Successful Response", "content": answer}},
    }


def install(app: FastAPI) -> None:
    """`app.openapi()` with the inference routes in it, built once."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = build()
            paths, components = inference_paths()
            schema["paths"] = {**paths, **schema.get("paths", {})}
            schema.setdefault("components", {}).setdefault("schemas", {}).update(components)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
