"""An adapter version on canary, judged by its outcomes: `/v1/feedback` grades answers, the
ledger's success report splits them by version, and an outcome rule over success rate and $ per
success (pricing/release_gate.py) promotes the canary or rolls it back (docs/adapters.md#canary).
`CanaryGate` applies the configured rule to every canary every `canary.evaluate_s` seconds
(docs/posttraining.md#the-gate); the routes apply it on request.

    POST /admin/adapters/{name}/canary/evaluate   apply the rule now (body: the rule, optional)
    GET  /admin/adapters/{name}/canary/decisions  this gateway's decisions on the adapter's canaries
    POST /admin/adapters/{name}/promote           the canary serves every request
    POST /admin/adapters/{name}/rollback          (gateway/adapters.py) the canary's share goes back
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from starlette.responses import Response

from yieldgate.pricing.release_gate import CanaryGateConfig, OutcomeRule, verdict
from yieldgate.pricing.report import SuccessRow
from yieldgate.serving import AdapterError, Adapters, engine_name

from .accounting import Accounting
from .adapters import adapter_api_error, adapter_doc
from .errors import APIError
from .http import decode_body, json_response
from .ticker import Ticker

log = logging.getLogger("yieldgate.canary")
DECISIONS_KEPT = 200


class CanaryGate:
    """Judges adapter canaries: on request (`evaluate`) and on a timer over every canary."""

    def __init__(self, adapters: Adapters, accounting: Accounting, config: CanaryGateConfig):
        self.adapters, self.accounting, self.config = adapters, accounting, config
        self.decisions: deque[dict[str, Any]] = deque(maxlen=DECISIONS_KEPT)  # promote/rollback, newest last
        self.ticker = Ticker("yieldgate-canary-gate", config.evaluate_s, self.evaluate_all)

    async def start(self) -> None:
        if self.config.evaluate_s > 0 and self.accounting.ledger is not None:
            self.ticker.start()

    async def close(self) -> None:
        await self.ticker.close()

    async def evaluate_all(self) -> None:
        """The timer's tick: every canary, by the configured rule."""
        for name in [n for n, a in self.adapters.adapters.items() if a.canary is not None]:
            try:
                await self.evaluate(name, self.config.rule, by="timer")
            except (AdapterError, APIError) as exc:  # another gateway or an admin decided first
                log.info("canary of %s: %s", name, exc)
            except Exception:  # the next tick tries again; the gate must outlive one bad read
                log.exception("canary of %s: evaluation failed", name)

    async def evaluate(self, name: str, rule: OutcomeRule, by: str) -> dict[str, Any]:
        """Apply `rule` to the canary of adapter `name` now; promote or roll back as it says."""
        adapter = self.adapters.adapters.get(name)
        if adapter is None:
            raise APIError(f"No adapter named {name!r}.", status=404, code="adapter_not_found")
        canary = adapter.canary
        if canary is None:
            raise APIError(f"Adapter {name!r} has no version on canary.", status=409, code="adapter_conflict")
        ledger = await self.accounting.flushed_ledger()
        rows = {r.group["weight_version"]: r for r in await ledger.success(("adapter", "weight_version"),
                                                                             since=canary.started)
                if r.group["adapter"] == name}
        stable_version = adapter.current
        stable_label, canary_label = engine_name(name, stable_version), engine_name(name, canary.version)
        stable, trial = rows.get(stable_label) or SuccessRow({}), rows.get(canary_label) or SuccessRow({})
        decision, why = verdict(stable, trial, rule)
        if decision == "promote":
            await self.adapters.promote(name, canary.version)
        elif decision == "rollback":  # of this canary only, not of the version that serves
            await self.adapters.rollback(name, canary.version)
        doc = {"verdict": decision, "reason": why, "rule": rule, "versions": {stable_label: stable, canary_label: trial}}
        if decision != "wait":
            self.decisions.append({"adapter": name, "version": canary.version, "stable": stable_version,
                                   "by": by, "at": time.time(), **doc})
            log.warning("adapter %s: canary %s %s by %s (%s)", name, canary.version,
                        "promoted" if decision == "promote" else "rolled back", by, why)
        return doc


def build_adapter_canary_router(adapters: Adapters, gate: CanaryGate,
                                admin: Callable[[Request], None]) -> APIRouter:
    router = APIRouter(prefix="/admin/adapters", dependencies=[Depends(admin)])

    async def adapter_call(call: Awaitable) -> Any:
        try:
            return await call
        except AdapterError as exc:  # e.g. promoted or rolled back by another call meanwhile
            raise adapter_api_error(exc) from None

    @router.post("/{name}/promote")
    async def promote(name: str) -> Response:
        await adapter_call(adapters.promote(name))
        return json_response(await adapter_doc(adapters, name))

    @router.post("/{name}/canary/evaluate")
    async def evaluate(name: str, request: Request) -> Response:
        rule: OutcomeRule = await decode_body(request, OutcomeRule)
        doc = await adapter_call(gate.evaluate(name, rule, by="admin"))
        return json_response({**doc, "adapter": await adapter_doc(adapters, name)})

    @router.get("/{name}/canary/decisions")
    async def decisions(name: str) -> Response:
        return json_response({"object": "list", "data": [d for d in gate.decisions if d["adapter"] == name]})

    return router
