"""The load generator: drives seeded sessions at a target under a load model and records every request.

`run_load` is the single entry point other benchmarks reuse (routing, weight rollout, gateway
overhead); `run_compare` runs the same seeded workload against several targets in turn or
interleaved.
"""

from __future__ import annotations

import asyncio
import math
import random
import secrets
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeVar

import msgspec

from . import engine_metrics
from .client import OpenAIClient, RequestOutcome
from .load import Bounds, ConcurrencyLoad, Load, PoissonLoad, ReplayLoad, SweepLoad
from .price import PriceTable
from .record import RequestRecord
from .summary import Summary, summarize
from .target import Target
from .workload import Session, Turn, Workload

OnRecord = Callable[[RequestRecord], None]
# Sees each request's conversation (chat messages, before the wire renders it) as it is sent:
# benchmarks compute the oracle's cached tokens from the exact prompts.
OnBody = Callable[[Session, int, list[dict[str, Any]]], None]
SLO_KEYS = frozenset({"ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"})  # itl_ms bounds a request's worst gap


class CacheSalt(msgspec.Struct, frozen=True, kw_only=True):
    """Keeps runs from sharing prefix cache: prefix every prompt with a salt and/or send vLLM's
    `cache_salt` field (the engine then hashes blocks with the salt)."""

    value: str
    mode: Literal["prefix", "field", "both"] = "prefix"

    @classmethod
    def random(cls, mode: Literal["prefix", "field", "both"] = "prefix") -> "CacheSalt":
        return cls(value=secrets.token_hex(6), mode=mode)


class RunResult(msgspec.Struct, kw_only=True):
    target: str
    summary: Summary
    records: list[RequestRecord]
    workload: dict[str, Any] = {}
    load: dict[str, Any] = {}
    bounds: dict[str, Any] = {}
    steps: list["RunResult"] = []  # one per rate of a sweep; `summary` is then the best step's
    stop_reason: str | None = None  # why a sweep stopped early
    started_at: float = 0.0  # unix time

    def to_summary_dict(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        out.pop("records", None)
        for step in out.get("steps", []):
            step.pop("records", None)
        return out


class _Phase:
    """Counters and bounds shared by the tasks of one run phase (warm-up or measured)."""

    def __init__(self, requests: int | None, duration_s: float | None, start_id: int, t0: float,
                 *, warmup: bool = False) -> None:
        self.next_id = start_id
        self._start = start_id
        self.limit = requests
        self.warmup = warmup
        self.t0 = t0
        self.deadline = None if duration_s is None else time.perf_counter() + duration_s
        self.records: list[RequestRecord] = []

    def claim(self) -> tuple[int, bool] | None:
        """Reserve the next request slot: (id, is_warmup), or None when the phase is over."""
        if self.stopped():
            return None
        rid = self.next_id
        self.next_id += 1
        return rid, self.warmup

    def release(self) -> None:
        self.next_id -= 1  # a claimed slot that sent nothing

    def stopped(self) -> bool:
        if self.limit is not None and self.next_id - self._start >= self.limit:
            return True
        return self.deadline is not None and time.perf_counter() >= self.deadline


class Runner:
    """Sends one target's share of a workload; keeps its session stream across phases."""

    def __init__(
        self,
        target: Target,
        workload: Workload,
        *,
        prices: PriceTable | None = None,
        cache_salt: CacheSalt | None = None,
        on_record: OnRecord | None = None,
        seed: int = 0,
        timeout_s: float = 120.0,
        on_body: OnBody | None = None,
    ) -> None:
        self.on_body = on_body
        self.target = target
        self.workload = workload
        self.prices = prices
        self.salt = cache_salt
        self.on_record = on_record
        self._sessions: Iterator[Session] = workload.sessions()
        self._pushback: Session | None = None
        self._arrivals = random.Random(f"{seed}:arrivals")
        self._next_id = 0
        self._client = OpenAIClient(target, timeout_s=timeout_s)
        price = prices.for_target(target.label, target.model) if prices else None
        self._price = price
        self._salt_extra = {"cache_salt": cache_salt.value} if cache_salt and cache_salt.mode != "prefix" else None
        self._salt_prefix = f"[cache-salt {cache_salt.value}]\n" if cache_salt and cache_salt.mode != "field" else ""

    def _next_session(self) -> Session | None:
        if self._pushback is not None:
            session, self._pushback = self._pushback, None
            return session
        return next(self._sessions, None)

    async def __aenter__(self) -> "Runner":
        await self._client.__aenter__()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._client.__aexit__(*exc)

    # -- one phase -------------------------------------------------------------------------------

    async def run_phase(self, load: Load, bounds: Bounds, *, slo: dict[str, float] | None = None,
                        engine_urls: list[str] | None = None) -> tuple[Summary, list[RequestRecord], float]:
        """Run one bounded phase; returns (summary, records, measured duration)."""
        if isinstance(load, SweepLoad):
            raise TypeError("run_phase takes one rate; use run_load/run_compare for sweeps")
        if isinstance(load, PoissonLoad) and not math.isfinite(load.rate) and bounds.requests is None:
            raise ValueError("an infinite rate needs a request bound")
        engine_urls = engine_urls or []
        t0 = time.perf_counter()
        records: list[RequestRecord] = []
        if bounds.warmup_requests:
            # Warm-up runs to completion under the same load model before anything is measured,
            # so engine counter deltas and client CPU below cover measured requests only.
            warm = _Phase(bounds.warmup_requests, None, self._next_id, t0, warmup=True)
            await self._drive(warm, load, bounds)
            self._next_id = warm.next_id
            records += warm.records
        before = await engine_metrics.scrape_all(engine_urls)
        phase = _Phase(bounds.requests, bounds.duration_s, self._next_id, t0)
        cpu0 = time.process_time()
        await self._drive(phase, load, bounds)
        cpu = time.process_time() - cpu0
        self._next_id = phase.next_id
        after = await engine_metrics.scrape_all(engine_urls)
        delta = engine_metrics.delta(engine_urls, before, after) if engine_urls else None
        records += phase.records
        measured = phase.records
        duration = (max(r.end_s for r in measured) - min(r.start_s for r in measured)) if measured else 0.0
        offered = load.rate if isinstance(load, PoissonLoad) else None
        conc = load.concurrency if isinstance(load, ConcurrencyLoad) else load.max_concurrency
        summary = summarize(self.target.label, records, duration_s=duration, slo=slo, engine=delta,
                            client_cpu_s=cpu, offered_rate=offered, concurrency=conc)
        return summary, records, duration

    async def _drive(self, phase: _Phase, load: Load, bounds: Bounds) -> None:
        if isinstance(load, ConcurrencyLoad):
            await self._closed_loop(phase, load.concurrency, bounds)
        else:
            await self._open_loop(phase, load, bounds)  # type: ignore[arg-type]

    async def _closed_loop(self, phase: _Phase, concurrency: int, bounds: Bounds) -> None:
        async def worker() -> None:
            while True:
                slot = phase.claim()
                if slot is None:
                    return
                session = self._next_session()
                if session is None:
                    phase.release()
                    return
                await self._session(phase, session, slot, time.perf_counter())

        await self._drain(phase, bounds, [asyncio.create_task(worker()) for _ in range(max(1, concurrency))])

    async def _open_loop(self, phase: _Phase, load: PoissonLoad | ReplayLoad, bounds: Bounds) -> None:
        sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
        tasks: set[asyncio.Task] = set()
        start = time.perf_counter()
        next_at = start
        behind = 0
        replay_base: float | None = None
        while not phase.stopped():
            session = self._next_session()
            if session is None:
                break
            if isinstance(load, ReplayLoad):
                # Relative to this phase's first session, so a later phase does not wait out the past.
                if replay_base is None:
                    replay_base = session.arrival_s or 0.0
                next_at = start + ((session.arrival_s or 0.0) - replay_base) / load.speedup
            delay = next_at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            else:
                behind += 1
                if behind % 32 == 0:
                    await asyncio.sleep(0)  # behind schedule: still let in-flight requests progress
            slot = phase.claim()
            if slot is None:
                self._pushback = session  # the next phase starts with it: targets stay in lockstep
                break
            task = asyncio.create_task(self._session(phase, session, slot, next_at, sem))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            if isinstance(load, PoissonLoad) and math.isfinite(load.rate):
                # Gamma with shape k and scale 1/(rate*k) keeps the mean gap at 1/rate.
                k = load.burstiness
                next_at += self._arrivals.gammavariate(k, 1.0 / (load.rate * k))
        await self._drain(phase, bounds, list(tasks))

    async def _drain(self, phase: _Phase, bounds: Bounds, tasks: list[asyncio.Task]) -> None:
        """Wait for the phase's tasks; cancel them only once no request has finished for
        drain_timeout_s + timeout_s (every request ends within timeout_s, so that is a stuck
        harness). A closed loop's workers live as long as the phase, so a fixed deadline from
        here would cut off every run longer than that window (64 requests were, at 80k requests)."""
        pending = set(tasks)
        finished = -1
        while pending:
            done, pending = await asyncio.wait(pending, timeout=bounds.drain_timeout_s + bounds.timeout_s)
            broken = [t for t in done if not t.cancelled() and t.exception() is not None]
            if pending and (broken or len(phase.records) == finished):
                for t in pending:
                    t.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
                pending = set()
            if broken:
                raise broken[0].exception()  # a bug in the harness, not a failed request
            finished = len(phase.records)

    # -- one session -------------------------------------------------------------------------------

    async def _session(self, phase: _Phase, session: Session, slot: tuple[int, bool], scheduled: float,
                       sem: asyncio.Semaphore | None = None) -> None:
        # The conversation as OpenAI chat messages; the target's wire format renders it.
        messages: list[dict[str, Any]] = []
        if session.system is not None:
            messages.append({"role": "system", "content": self._salt_prefix + session.system})
        for k, turn in enumerate(session.turns):
            if k > 0:
                if turn.think_time_s > 0:
                    await asyncio.sleep(turn.think_time_s)
                got = phase.claim()
                if got is None:
                    return
                slot, scheduled = got, time.perf_counter()
            _append_turn(messages, turn, self._salt_prefix)
            # OpenAI's `user` names the conversation, so session-affine routers can keep it together
            # (Messages carries it as metadata.user_id).
            extra: dict[str, Any] = dict(self._salt_extra or {})
            if self.target.api == "messages":
                extra["metadata"] = {"user_id": session.id}
            else:
                extra["user"] = session.id
            if session.adapter is not None:
                extra["model"] = session.adapter
            body = self._client.build_body(messages, None, turn.max_tokens, extra, session.tools)
            if self.on_body is not None:
                self.on_body(session, k, messages)
            if sem is not None:
                async with sem:
                    out = await self._send(body)
            else:
                out = await self._send(body)
            rec = self._record(phase, session, k, slot, scheduled, turn.input_tokens_est, out)
            phase.records.append(rec)
            if self.on_record is not None:
                self.on_record(rec)
            if not rec.ok:
                return  # an agent does not continue a conversation whose last call failed
            messages.append({"role": "assistant", "content": out.text})

    async def _send(self, body: bytes) -> RequestOutcome:
        try:
            return await self._client.send(body)
        except asyncio.CancelledError:
            now = time.perf_counter()
            return RequestOutcome(start=now, end=now, error="cancelled", error_detail="still running at drain timeout")

    def _record(self, phase: _Phase, session: Session, turn: int, slot: tuple[int, bool], scheduled: float,
                est: int, out: RequestOutcome) -> RequestRecord:
        t0 = phase.t0
        rec = RequestRecord(
            id=slot[0], target=self.target.label, session=session.id, turn=turn, group=session.group,
            warmup=slot[1], scheduled_s=scheduled - t0, start_s=out.start - t0, end_s=out.end - t0,
            status=out.status, error=out.error, error_detail=out.error_detail, input_tokens_est=est,
            output_chars=len(out.text), request_id=out.request_id, replica=out.replica, weight_version=out.weight_version,
            predicted_cached_tokens=out.predicted_cached_tokens,
        )
        if out.error is not None:
            return rec
        rec.ok = True
        rec.e2e_ms = (out.end - out.start) * 1000.0
        if out.first_token is not None:
            rec.ttft_ms = (out.first_token - out.start) * 1000.0
        times = out.token_times
        if len(times) > 1:
            rec.itl_ms = [(b - a) * 1000.0 for a, b in zip(times, times[1:])]
        usage = out.usage
        if usage is not None:
            rec.prompt_tokens = usage.prompt_tokens if usage.prompt_tokens is not None else est
            rec.completion_tokens = usage.completion_tokens if usage.completion_tokens is not None else len(times)
            rec.cached_tokens = usage.cached_tokens
        else:
            rec.completion_tokens = len(times)
            rec.prompt_tokens = est
        n_out = rec.completion_tokens
        if n_out > 1 and out.first_token is not None and self.target.stream and times:
            # First to last token, as vllm bench serve and GuideLLM define it: the usage chunk,
            # [DONE] and connection close after the last token are E2E time, not decode time.
            rec.tpot_ms = (times[-1] - out.first_token) * 1000.0 / (n_out - 1)
        cost = out.cost
        if cost is not None:
            rec.cost, rec.cost_source = cost, "response"
        elif self._price is not None:
            rec.cost = self._price.cost(rec.prompt_tokens, rec.cached_tokens, n_out)
            rec.cost_source = "price_table"
        return rec


def _append_turn(messages: list[dict[str, Any]], turn: Turn, salt_prefix: str) -> None:
    """A turn's new messages: with a tool call, the previous answer becomes the assistant's call and
    the tool output its result message; without, a tool output is user text before the question."""
    if turn.tool_call is not None and turn.tool_output is not None:
        call = turn.tool_call
        if messages and messages[-1]["role"] == "assistant":
            messages[-1]["tool_calls"] = [{"id": call.id, "type": "function",
                                           "function": {"name": call.name, "arguments": call.arguments}}]
            messages.append({"role": "tool", "tool_call_id": call.id, "content": turn.tool_output})
        content = turn.user
    else:
        content = turn.user if turn.tool_output is None else f"{turn.tool_output}\n\n{turn.user}"
    if not messages and salt_prefix:
        content = salt_prefix + content
    if content:
        messages.append({"role": "user", "content": content})


# -- public entry points ------------------------------------------------------------------------


T = TypeVar("T")


def turn_order(items: Sequence[T], round_index: int) -> list[T]:
    """The order in which side-by-side targets take their turns in round `round_index`: as given in
    even rounds, reversed in odd ones (A B, B A, ...). On a shared machine the phase that goes second
    in a round can run faster or slower than the first; alternating spreads that over every target."""
    return list(items) if round_index % 2 == 0 else list(items)[::-1]


def _slices(load: Load, bounds: Bounds, rounds: int) -> list[tuple[Load, Bounds]]:
    """The phases one target runs: a sweep's steps, or `rounds` equal parts of a plain run."""
    if isinstance(load, SweepLoad):
        step = PoissonLoad
        return [(step(rate=r, burstiness=load.burstiness, max_concurrency=load.max_concurrency), bounds)
                for r in load.schedule()]
    if rounds <= 1:
        return [(load, bounds)]
    per = msgspec.structs.replace(
        bounds,
        requests=None if bounds.requests is None else max(1, bounds.requests // rounds),
        duration_s=None if bounds.duration_s is None else bounds.duration_s / rounds,
    )
    return [(load, per)] * rounds


def _sweep_stop(load: SweepLoad, summary: Summary, first: Summary | None) -> str | None:
    if summary.requests and summary.failed / summary.requests > load.max_error_rate:
        return f"error rate {summary.failed / summary.requests:.1%} > {load.max_error_rate:.1%}"
    # Compare with the realized arrival rate, not the nominal one: a short Poisson step can send
    # 20% below its nominal rate by chance without the target being saturated.
    sent = summary.sent_rate or summary.offered_rate
    if sent and summary.request_throughput < load.min_achieved_ratio * sent:
        return (f"achieved {summary.request_throughput:.2f} req/s < {load.min_achieved_ratio:.0%} of sent "
                f"{sent:.2f} (offered {summary.offered_rate:g})")
    if first is not None and first.ttft_ms.count and summary.ttft_ms.count:
        base = first.ttft_ms.p(50)
        if base > 0 and summary.ttft_ms.p(50) > load.max_ttft_growth * base:
            return f"p50 TTFT {summary.ttft_ms.p(50):.0f} ms > {load.max_ttft_growth:g}x first step ({base:.0f} ms)"
    return None


async def arun_compare(
    targets: list[Target],
    workload: Workload,
    load: Load,
    bounds: Bounds | None = None,
    *,
    order: Literal["sequential", "interleaved"] = "sequential",
    rounds: int = 4,
    slo: dict[str, float] | None = None,
    prices: PriceTable | None = None,
    engine_metrics_urls: list[str] | None = None,
    cache_salt: CacheSalt | Literal["auto"] | None = None,
    on_record: OnRecord | None = None,
    on_phase: Callable[[str, int, int], None] | None = None,
    seed: int = 0,
    on_body: OnBody | None = None,
) -> list[RunResult]:
    """Run the same seeded workload against each target; results in `targets` order.

    interleaved: the run is split into `rounds` phases (or a sweep's rate steps) and the targets
    take turns phase by phase, so drift in the machine affects all of them alike; every other round
    runs them in reverse order (A B, B A, ...), so going first or second in a round does not
    favour one target either.
    cache_salt="auto": a fresh salt per target, so no target rides on another's prefix cache.
    """
    bounds = bounds or Bounds()
    unknown = set(slo or {}) - SLO_KEYS
    if unknown:
        raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; use {sorted(SLO_KEYS)}")
    runners: list[Runner] = []
    for t in targets:
        salt = CacheSalt.random() if cache_salt == "auto" else cache_salt
        runners.append(Runner(t, workload, prices=prices, cache_salt=salt, on_record=on_record, seed=seed,
                              timeout_s=bounds.timeout_s, on_body=on_body))
    plans = [_slices(load, bounds, rounds if order == "interleaved" else 1) for _ in targets]
    n_phases = len(plans[0])
    outputs: list[list[tuple[Summary, list[RequestRecord], float]]] = [[] for _ in targets]
    stopped: list[str | None] = [None] * len(targets)
    started = [0.0] * len(targets)
    turns = list(range(len(targets)))
    schedule: list[tuple[int, int]] = (
        [(i, p) for p in range(n_phases) for i in turn_order(turns, p)] if order == "interleaved"
        else [(i, p) for i in turns for p in range(n_phases)]
    )
    for r in runners:
        await r.__aenter__()
    try:
        for i, p in schedule:
            if stopped[i]:
                continue
            if not started[i]:
                started[i] = time.time()
            if on_phase is not None:
                on_phase(targets[i].label, p, n_phases)
            phase_load, phase_bounds = plans[i][p]
            res = await runners[i].run_phase(phase_load, phase_bounds, slo=slo, engine_urls=engine_metrics_urls)
            outputs[i].append(res)
            if isinstance(load, SweepLoad):
                stopped[i] = _sweep_stop(load, res[0], outputs[i][0][0] if p else None)
    finally:
        for r in runners:
            await r.__aexit__(None, None, None)
    return [
        _assemble(t, outputs[i], workload, load, bounds, slo, stopped[i], started[i], engine_metrics_urls)
        for i, t in enumerate(targets)
    ]


def _assemble(target: Target, phases: list[tuple[Summary, list[RequestRecord], float]], workload: Workload,
              load: Load, bounds: Bounds, slo: dict[str, float] | None, stop: str | None, started: float,
              engine_urls: list[str] | None) -> RunResult:
    common = dict(workload=workload.describe(), load=msgspec.to_builtins(load),
                  bounds=msgspec.to_builtins(bounds), started_at=started)
    # Lay phases end to end on one timeline so merged records never overlap.
    records: list[RequestRecord] = []
    offset = 0.0
    for _, recs, _ in phases:
        span = max((r.end_s for r in recs), default=0.0)
        for r in recs:
            records.append(msgspec.structs.replace(r, scheduled_s=r.scheduled_s + offset,
                                                   start_s=r.start_s + offset, end_s=r.end_s + offset))
        offset += span
    if isinstance(load, SweepLoad):
        steps = [RunResult(target=target.label, summary=s, records=recs, **common) for s, recs, _ in phases]
        best = max(steps, key=lambda st: (st.summary.goodput or st.summary.request_throughput))
        return RunResult(target=target.label, summary=best.summary, records=records, steps=steps,
                         stop_reason=stop, **common)
    if len(phases) == 1:
        return RunResult(target=target.label, summary=phases[0][0], records=records, **common)
    merged_engine = None
    engines = [s.engine for s, _, _ in phases if s.engine]
    if engines:
        counters: dict[str, float] = {}
        for e in engines:
            for k, v in e["counters"].items():
                counters[k] = counters.get(k, 0.0) + v
        merged_engine = engine_metrics.EngineDelta(urls=list(engine_urls or []), counters=counters)
    cpu = [s.client_cpu_us_per_request * s.requests / 1e6 for s, _, _ in phases
           if s.client_cpu_us_per_request is not None]
    first = phases[0][0]
    summary = summarize(target.label, records, duration_s=sum(d for _, _, d in phases), slo=slo,
                        engine=merged_engine, client_cpu_s=sum(cpu) if cpu else None,
                        offered_rate=first.offered_rate, concurrency=first.concurrency)
    return RunResult(target=target.label, summary=summary, records=records, **common)


async def arun_load(target: Target, workload: Workload, load: Load, bounds: Bounds | None = None,
                    **kwargs: Any) -> RunResult:
    """One target, one workload, one load model. kwargs as `arun_compare` (slo, prices, ...)."""
    return (await arun_compare([target], workload, load, bounds, **kwargs))[0]


def _run(coro: Any) -> Any:
    try:
        import uvloop  # the client's own overhead matters at 1k+ RPS
    except ImportError:  # pragma: no cover
        return asyncio.run(coro)
    return uvloop.run(coro)


def run_load(target: Target, workload: Workload, load: Load, bounds: Bounds | None = None,
             **kwargs: Any) -> RunResult:
    """Blocking `arun_load` (uses uvloop when installed). Do not call from a running event loop."""
    return _run(arun_load(target, workload, load, bounds, **kwargs))


def run_compare(targets: list[Target], workload: Workload, load: Load, bounds: Bounds | None = None,
                **kwargs: Any) -> list[RunResult]:
    return _run(arun_compare(targets, workload, load, bounds, **kwargs))
