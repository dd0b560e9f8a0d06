"""What every inference request goes through before routing (the first step of the pipeline in
gateway/exchange.py, whichever front door it came in by): validate the body, resolve model and
tier, open its RequestContext, and the bytes to send upstream.
"""

from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from yieldgate.pricing import ApiKey

from .apis import APIS
from .config import RequestLimits
from .context import RequestContext
from .errors import InvalidRequest, param_from_msgspec
from .tiers import FAST, FLEX, resolve_tier

if TYPE_CHECKING:
    from .registry import ModelPool, ModelRegistry

_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder(decimal_format="number").encode


@dataclass(slots=True)
class Intake:
    """A validated request: its JSON as a dict (unknown fields kept), its typed view, its context,
    and the pool of the model it names."""

    raw: dict[str, Any]
    typed: Any
    ctx: RequestContext
    pool: "ModelPool"


def parse_request(kind: str, body: bytes, limits: RequestLimits) -> tuple[dict[str, Any], Any]:
    """The body as a dict and as the API's typed request; InvalidRequest (400) when it is not one."""
    if not body:
        raise InvalidRequest("Request body is empty; expected a JSON object.")
    try:
        raw = _decode(body)
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # msgspec refuses nesting deeper than ~1000 levels
        raise InvalidRequest("Request body is nested too deeply.", code="invalid_json") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("Request body must be a JSON object.", code="invalid_json")
    try:
        typed = msgspec.convert(raw, APIS[kind].request)
    except msgspec.ValidationError as exc:
        message = str(exc)
        raise InvalidRequest(message, param=param_from_msgspec(message), code="invalid_value") from None
    if kind != "completions":
        items, name = (typed.input, "input") if kind == "responses" else (typed.messages, "messages")
        if not isinstance(items, str) and len(items) > limits.max_messages:
            raise InvalidRequest(f"Too many {name}: at most {limits.max_messages}.", param=name)
    if (typed.output_limit or 0) > limits.max_tokens:
        param = "max_output_tokens" if kind == "responses" else "max_tokens"
        raise InvalidRequest(f"{param} must be at most {limits.max_tokens}.", param=param,
                             code="invalid_value")
    if kind == "completions" and not typed.prompt:
        raise InvalidRequest("prompt must not be empty.", param="prompt")
    if kind == "responses":
        if not typed.input:
            raise InvalidRequest("input must not be empty.", param="input")
        if typed.background:
            # A background response is answered before it is generated: nothing would bill it.
            raise InvalidRequest("background responses are not served by this gateway; stream "
                                 "instead.", param="background", code="unsupported_value")
    return raw, typed


def open_request(kind: str, body: bytes, headers: dict[bytes, bytes], key: ApiKey | None,
                 registry: "ModelRegistry", limits: RequestLimits, started: float | None = None) -> Intake:
    """Parse the body, resolve model and tier (404 for a name that is no model, adapter, alias nor
    `auto` of the gateway: gateway/registry.py) and open the request's context. `headers` are the
    raw request headers with lower-case names."""
    raw, typed = parse_request(kind, body, limits)
    session = header(headers, b"x-session-id") or typed.user or ""
    task = task_class(headers, raw)  # recorded for every request that names one: `auto` learns from all
    found = registry.resolve(typed.model, session, task)
    _, tier = resolve_tier(found.model, typed.requested_service_tier)
    # An adapter is priced and recorded as its base model, the adapter and version beside it.
    ctx = RequestContext(
        request_id=request_id(headers),
        kind=kind, model=found.pool.name, tier=tier, started=time.perf_counter() if started is None else started,
        stream=typed.stream, session_id=session, key=key,
        max_tokens=typed.output_limit, typed=typed, adapter=found.adapter,
        requested_model=found.requested, task=found.task or task, auto_reason=found.reason,
    )
    if tier != FAST and typed.requested_service_tier == FLEX:
        ctx.lane = ctx.priced_tier = FLEX  # served by its tier behind interactive work, at the flex price
    return Intake(raw, typed, ctx, found.pool)


def task_class(headers: dict[bytes, bytes], raw: dict[str, Any]) -> str:
    """The request's task class for `auto`: the x-yieldgate-task header, else `metadata.task`
    (OpenAI's free-form request metadata); "" = unlabelled."""
    given = header(headers, b"x-yieldgate-task")
    if not given:
        metadata = raw.get("metadata")
        task = metadata.get("task") if isinstance(metadata, dict) else None
        given = task if isinstance(task, str) else ""
    return given[:64] if given.isprintable() else ""


def upstream_payload(intake: Intake, body: bytes) -> bytes:
    """The bytes for the engine: the client's own unless a field must change (the served model
    name for a `:fast` suffix or an adapter version's engine name; usage asked for on a stream
    that did not ask for it)."""
    raw, typed, ctx = intake.raw, intake.typed, intake.ctx
    model = ctx.adapter.engine_name if ctx.adapter is not None else ctx.model
    if model == typed.model and typed.shows_usage and not ctx.priority and "priority" not in raw:
        return body  # nothing to change: forward the client's bytes as they came
    raw["model"] = model
    # vLLM's --scheduling-policy priority (lower first): the lane's, never one the client chose.
    if ctx.priority:
        raw["priority"] = ctx.priority
    else:
        raw.pop("priority", None)
    if typed.stream and not typed.shows_usage:
        # Always ask the engine for usage: every streamed token is billed, even if the client
        # did not ask to see the usage event.
        options = raw.get("stream_options") or {}
        options["include_usage"] = True
        raw["stream_options"] = options
    return _encode(raw)


# Request ids: a random prefix per process and a counter (the ledger keys records by request id,
# so ids must not repeat across processes or restarts; a syscall per request is not needed for that).
_ID_PREFIX = f"req-{os.urandom(10).hex()}"
_ids = itertools.count()


def _new_id_prefix() -> None:  # a forked worker gets a prefix of its own
    global _ID_PREFIX
    _ID_PREFIX = f"req-{os.urandom(10).hex()}"


os.register_at_fork(after_in_child=_new_id_prefix)


def request_id(headers: dict[bytes, bytes]) -> str:
    """The client's x-request-id if it is printable (it is forwarded upstream as a header line)."""
    given = header(headers, b"x-request-id")
    return given if given and given.isprintable() else f"{_ID_PREFIX}{next(_ids):012x}"


def header(headers: dict[bytes, bytes], name: bytes) -> str:
    value = headers.get(name)
    return value.decode("latin-1") if value else ""
