"""An adapter version on canary, judged by its outcomes: `/v1/feedback` grades answers, the
ledger's success report splits them by version, and an outcome rule over success rate and $ per
success (pricing/release_gate.py) promotes the canary or rolls it back (docs/adapters.md#canary).

    POST /admin/adapters/{name}/canary/evaluate   apply the rule now (body: the rule, optional)
    POST /admin/adapters/{name}/promote           the canary serves every request
    POST /admin/adapters/{name}/rollback          (gateway/adapters.py) the canary's share goes back
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from yieldgate.pricing.release_gate import OutcomeRule, verdict
from yieldgate.pricing.report import SuccessRow
from yieldgate.serving import AdapterError, Adapters, engine_name

from .accounting import Accounting
from .adapters import adapter_api_error, adapter_doc
from .errors import APIError
from .http import decode_body, json_response


def build_adapter_canary_router(adapters: Adapters, accounting: Accounting,
                                admin: Callable[[Request], None]) -> APIRouter:
    router = APIRouter(prefix="/admin/adapters", dependencies=[Depends(admin)])

    async def adapter_call(call: Awaitable) -> None:
        try:
            await call
        except AdapterError as exc:  # e.g. promoted or rolled back by another call meanwhile
            raise adapter_api_error(exc) from None

    @router.post("/{name}/promote")
    async def promote(name: str) -> Response:
        await adapter_call(adapters.promote(name))
        return json_response(await adapter_doc(adapters, name))

    @router.post("/{name}/canary/evaluate")
    async def evaluate(name: str, request: Request) -> Response:
        rule: OutcomeRule = await decode_body(request, OutcomeRule)
        adapter = adapters.adapters.get(name)
        if adapter is None:
            raise APIError(f"No adapter named {name!r}.", status=404, code="adapter_not_found")
        canary = adapter.canary
        if canary is None:
            raise APIError(f"Adapter {name!r} has no version on canary.", status=409, code="adapter_conflict")
        ledger = await accounting.flushed_ledger()
        rows = {r.group["weight_version"]: r for r in await ledger.success(("adapter", "weight_version"),
                                                                             since=canary.started)
                if r.group["adapter"] == name}
        stable_label, canary_label = engine_name(name, adapter.current), engine_name(name, canary.version)
        stable, trial = rows.get(stable_label) or SuccessRow({}), rows.get(canary_label) or SuccessRow({})
        decision, why = verdict(stable, trial, rule)
        if decision == "promote":
            await adapter_call(adapters.promote(name, canary.version))
        elif decision == "rollback":  # of this canary only, not of the version that serves
            await adapter_call(adapters.rollback(name, canary.version))
        return json_response({"verdict": decision, "reason": why, "rule": rule,
                              "versions": {stable_label: stable, canary_label: trial}, "adapter": await adapter_doc(adapters, name)})

    return router
