"""The least a Python gateway on yieldgate's stack can spend per request: uvicorn (uvloop,
httptools), a bare ASGI callable, yieldgate's own upstream client, round robin over the replicas.
No parsing, key, routing, pricing, ledger or metrics. gateway_overhead_ab.py runs it as the variant
`floor`, so yieldgate's CPU per request splits into the stack's share and its features' share.

    python benchmarks/python_floor.py PORT UPSTREAM_URL [UPSTREAM_URL ...]
"""

from __future__ import annotations

import itertools
import sys

import uvicorn
from yieldgate.serving.upstream import Endpoint, UpstreamPool

_pool = UpstreamPool(connect_timeout_s=5, read_timeout_s=60)
_endpoints: itertools.cycle[Endpoint]


async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while (await receive())["type"] == "lifespan.startup":
            await _pool.start()
            await send({"type": "lifespan.startup.complete"})
        await _pool.close()
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/health":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})
        return
    chunks = []
    more = True
    while more:
        message = await receive()
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    resp = await _pool.post(next(_endpoints), b"".join(chunks))
    try:
        data = await resp.read()
    finally:
        resp.release()
    await send({"type": "http.response.start", "status": resp.status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": data})


def main() -> None:
    global _endpoints
    port, upstreams = int(sys.argv[1]), sys.argv[2:]
    _endpoints = itertools.cycle([Endpoint.parse(u + "/v1/chat/completions") for u in upstreams])
    uvicorn.run(app, host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
