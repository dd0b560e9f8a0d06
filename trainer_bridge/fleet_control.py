"""What a rollout needs from whoever routes traffic to the engines (`FleetControl`), the one
over bare engine URLs (`EngineFleet`), and how replicas are grouped into swap waves.

A replica is its engine's base URL. The gateway hands a rollout its own implementation
(`trainer_bridge.replica_fleet.ReplicaFleet`): routability is the gateway's, in-flight is its
own count, a hold queues new requests, notes go to the rollout's timeline.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import httpx

from yieldgate.serving import EngineControl, tls_context


@runtime_checkable
class FleetControl(Protocol):
    def replicas(self) -> Sequence[str]:
        """The engines this rollout updates (base URLs)."""

    def tier(self, replica: str) -> str:
        """The replica's tier: a wave never takes a tier's last routable replica out."""

    def name(self, replica: str) -> str:
        """The replica's key in the weight history and the timeline."""

    async def weight_version(self, replica: str) -> str:
        """What the replica serves now, as the engine names it ("default" before any update)."""

    async def set_routable(self, replica: str, routable: bool) -> None: ...

    async def inflight(self, replica: str) -> int:
        """Requests still running on the replica (0 = drained)."""

    async def hold(self, replicas: Sequence[str]) -> None:
        """All-at-once: new requests for `replicas` wait (not fail) until `release`."""

    async def release(self, replicas: Sequence[str]) -> None: ...

    def weights_changed(self, replica: str, verified: str | None) -> None:
        """The replica's weights are being replaced (`verified` None), or the rollout verified
        that it serves `verified` (label it: every response from now on names it)."""

    def note(self, event: str, replica: str = "", detail: str = "") -> None:
        """A step of the rollout, for its timeline."""


class EngineFleet:
    """`FleetControl` over bare engine URLs: routing is a local set, in-flight comes from each
    engine's /metrics, and a hold pauses the engines (`/pause?mode=wait`: running requests
    finish, new ones queue and run after `release`, on the new weights). For scripts and tests."""

    _RUNNING = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\}\s+([0-9.e+]+)", re.M)

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.routable = set(self.urls)
        self.paused: set[str] = set()

    def replicas(self) -> Sequence[str]:
        return list(self.urls)

    def tier(self, replica: str) -> str:
        return ""

    def name(self, replica: str) -> str:
        return replica

    async def weight_version(self, replica: str) -> str:
        async with EngineControl(replica, 30.0) as engine:
            return await engine.weight_version()

    async def set_routable(self, replica: str, routable: bool) -> None:
        (self.routable.add if routable else self.routable.discard)(replica)

    async def inflight(self, replica: str) -> int:
        if replica in self.paused:
            return 0  # paused with mode=wait: what it ran has finished; the queue waits for resume
        async with httpx.AsyncClient(timeout=10.0, verify=tls_context()) as http:
            text = (await http.get(replica + "/metrics")).text
        return int(sum(float(v) for v in self._RUNNING.findall(text)))

    async def hold(self, replicas: Sequence[str]) -> None:
        async def pause(url: str) -> None:
            async with EngineControl(url, 600.0) as engine:
                await engine.pause("wait")
            self.paused.add(url)

        await asyncio.gather(*(pause(r) for r in replicas))

    async def release(self, replicas: Sequence[str]) -> None:
        async def resume(url: str) -> None:
            async with EngineControl(url, 60.0) as engine:
                await engine.resume()
            self.paused.discard(url)

        await asyncio.gather(*(resume(r) for r in replicas if r in self.paused))

    def weights_changed(self, replica: str, verified: str | None) -> None:
        pass  # nothing labels a bare engine but the engine itself

    def note(self, event: str, replica: str = "", detail: str = "") -> None:
        pass


def swap_waves(replicas: Sequence[str], tier_of: Callable[[str], str]) -> list[list[str]]:
    """Group replicas into waves that swap together. A wave may take out several replicas of a
    tier as long as one of them stays routable; a tier with a single replica borrows the others
    while it is out, so at most one such tier is out at a time and something always stays."""
    size = {t: sum(tier_of(x) == t for x in replicas) for t in map(tier_of, replicas)}

    def allowed(out: set[str]) -> bool:
        left = [x for x in replicas if x not in out]
        lone = {tier_of(x) for x in out if size[tier_of(x)] == 1}
        shared_ok = all(
            any(tier_of(x) == tier_of(r) for x in left) for r in out if size[tier_of(r)] > 1
        )
        return bool(left) and len(lone) <= 1 and shared_ok

    pending = list(replicas)
    waves: list[list[str]] = []
    while pending:
        wave = [pending[0]]  # always progresses, even for a fleet of one
        for r in pending[1:]:
            if allowed(set(wave) | {r}):
                wave.append(r)
        waves.append(wave)
        pending = [r for r in pending if r not in wave]
    return waves
