"""A push intake: the gateway playing one engine for a trainer, for one rollout.

The trainer's calls reach it through the engine-shaped routes (`/weights/intake/<id>/...`).
With a fan-out, each engine of the push has its own receiver (the engine stages the trainer's
stream while it serves) and the gateway's copy is one more (for the checkpoint store);
otherwise the gateway's copy is the only receiver. Authenticated by the per-rollout push token:
init must present it, and every streamed chunk carries an HMAC made with it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from yieldgate.serving import EngineControl, EngineRefused, Replica
from . import wire
from .errors import PushRefused
from .receiver import ParamLayout, StagingArea, receive_update_async
from .schemas import RolloutState, WeightsRequest


class PushIntake:
    def __init__(self, state: RolloutState, token: str, request: WeightsRequest,
                 engines: dict[str, Replica] | None = None) -> None:
        self.state = state
        self.token = token
        self.request = request
        self.armed = False
        self.staged: dict[str, Any] | None = None  # the gateway's copy (checkpoint, fallbacks)
        # Fan-out: replica name -> replica the trainer streams to directly (armed with `token`),
        # and engine URL -> the session each one staged.
        self.engines = engines or {}
        self.sessions: dict[str, str] = {}
        self.finishing: asyncio.Task | None = None  # the rollout every finish call waits on
        self.early: list[Replica] = []  # the rolling update's first wave, out of routing early
        loop = asyncio.get_running_loop()
        # The gateway's own copy (for the checkpoint store). With a fan-out the rollout does not
        # wait for it: the engines verified their own copies, and rollback needs only N-1 on disk.
        self.copy: asyncio.Future[dict[str, Any]] = loop.create_future()
        self.copy.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        self.engines_staged = asyncio.Event()  # every fan-out engine staged, or one failed
        self.stage_failed = ""

    def require_armed(self) -> None:
        if not self.armed:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with the push token")

    def readmit_early(self, why: str, keep: frozenset[str] = frozenset()) -> None:
        """Put the wave drained early back into routing, but for the replicas in `keep`."""
        early, self.early = self.early, [r for r in self.early if r.url in keep]
        for r in early:
            if r.url not in keep and not r.admitted:
                r.admitted = True  # untouched: it still serves the weights it is labelled with
                self.state.note("admitted", r.name, f"{r.weight_version} ({why})")

    def stage_failure(self, engine: str, reason: str) -> None:
        """A fan-out engine did not stage: a finish call waiting for the others gives up."""
        if engine:
            self.stage_failed = self.stage_failed or f"{engine}: {reason}"
            self.engines_staged.set()

    async def open_session(self, engine: str) -> None:
        """Open the engine's update session (vLLM refuses /update_weights outside one). A session
        an abandoned push left open is ended first: nothing staged in it was ever applied."""
        self.require_armed()
        async with EngineControl(self.engines[engine].url, 60.0) as control:
            await control.open_session()

    async def stage(self, engine: str, info: dict[str, Any], start: bool = False) -> bool:
        """The engine pulls the trainer's stream into its staging buffers and verifies it in the
        background while it serves; the rollout applies it later. `start`: open its update
        session first, on the same connection. -> every engine of the push is staging now."""
        url = self.engines[engine].url
        async with EngineControl(url, 60.0) as control:
            try:
                if start:
                    await control.open_session()
                await control.stage(info)
            except EngineRefused as exc:
                raise PushRefused(str(exc)) from exc
        self.sessions[url] = str(info["session"])
        self.state.note("staging", engine, "the engine pulls the trainer's stream while it serves")
        if len(self.sessions) < len(self.engines):
            return False
        self.engines_staged.set()
        return True

    @staticmethod
    def staging_area(info: dict[str, Any]) -> StagingArea:
        """Buffers for the stream `info` describes (raises if the description is malformed)."""
        return StagingArea([ParamLayout(n, wire.parse_dtype(d), tuple(s)) for n, d, s in
                            zip(info["names"], info["dtype_names"], info["shapes"], strict=True)])

    async def receive(self, info: dict[str, Any], staging: StagingArea) -> None:
        """The gateway's copy: pull the trainer's stream into `staging`, verified."""
        t0 = time.perf_counter()
        try:
            await receive_update_async(info["sender"], bytes.fromhex(info["session"]), self.token,
                                       staging, info.get("checksum", "crc32"),
                                       float(info.get("timeout_s", 60.0)))
        except BaseException as exc:
            if not self.copy.done():
                self.copy.set_exception(exc)
            raise
        self.staged = dict(staging.items())
        if not self.copy.done():
            self.copy.set_result(self.staged)
        self.state.note("pushed", detail=f"{staging.total_bytes} bytes verified in "
                                         f"{time.perf_counter() - t0:.2f}s")
