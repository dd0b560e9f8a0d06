"""Rolling a new weight version through a fleet without serving a request from half-loaded
weights, and with a one-call way back.

The gateway plugs its fleet in through `Fleet` (three methods). Per replica (mode "rolling"):
take it out of routing, drain (in-flight == 0, bounded wait), update (yieldgate push, or a
checkpoint reload for engines without the plugin), reset its prefix cache, verify (health +
version + optional eval), re-admit. Mode "all_at_once" pauses every engine (`/pause?mode=wait`),
updates all, resets caches and resumes. Any failure restores the previous version from the
on-disk checkpoint on every replica this rollout touched, then raises RolloutFailed(reason).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

import httpx
import msgspec

from trainer_bridge.checkpoint import CheckpointStore
from trainer_bridge.config import BridgeConfig
from trainer_bridge.engine_client import EngineClient
from trainer_bridge.errors import BridgeError, RolloutFailed
from trainer_bridge.push import ModelLike, _weights, make_push_token, push, reload_from_checkpoint
from trainer_bridge.weights import WeightSet

log = logging.getLogger(__name__)

Evaluate = Callable[[str], Awaitable[bool]]  # replica URL -> passes?


@runtime_checkable
class Fleet(Protocol):
    """What a rollout needs from whoever routes traffic. A replica is its engine base URL."""

    def replicas(self) -> Sequence[str]: ...

    async def set_routable(self, replica: str, routable: bool) -> None: ...

    async def inflight(self, replica: str) -> int: ...


class EngineFleet:
    """A `Fleet` over bare engine URLs: routing is a local set, in-flight comes from each
    engine's /metrics. Enough for scripts and tests; the gateway supplies its own."""

    _RUNNING = re.compile(r"^vllm:num_requests_(?:running|waiting)\{[^}]*\}\s+([0-9.e+]+)", re.M)

    def __init__(self, urls: Sequence[str]) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.routable = set(self.urls)

    def replicas(self) -> Sequence[str]:
        return list(self.urls)

    async def set_routable(self, replica: str, routable: bool) -> None:
        (self.routable.add if routable else self.routable.discard)(replica)

    async def inflight(self, replica: str) -> int:
        async with httpx.AsyncClient(timeout=10.0) as http:
            text = (await http.get(replica + "/metrics")).text
        return int(sum(float(v) for v in self._RUNNING.findall(text)))


class RolloutReport(msgspec.Struct):
    version: str
    mode: str
    replicas: list[str]
    previous: dict[str, str]  # replica -> version it served before
    methods: dict[str, str]  # replica -> "push" | "reload"
    seconds: float


class Rollout:
    def __init__(
        self,
        fleet: Fleet,
        store: CheckpointStore,
        *,
        mode: Literal["rolling", "all_at_once"] = "rolling",
        evaluate: Evaluate | None = None,
        config: BridgeConfig | None = None,
        current_token: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.store = store
        self.mode = mode
        self.evaluate = evaluate
        self.config = config or BridgeConfig()
        # The push token engines are armed with; each rollout rotates it.
        self.token = current_token

    async def run(self, weights: ModelLike, version: str) -> RolloutReport:
        started = time.perf_counter()
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        if not replicas:
            raise RolloutFailed("fleet has no replicas")
        wset = _weights(weights, None)
        previous = {r: await asyncio.to_thread(_version, r) for r in replicas}
        for prev in set(previous.values()):
            self._ensure_checkpoint(prev)
        # Saved before any engine changes: this version becomes N-1 for the next rollout.
        await asyncio.to_thread(self.store.save, version, wset.state_dict())
        token = await self._rotate_token(replicas)

        touched: list[str] = []
        methods: dict[str, str] = {}
        try:
            if self.mode == "rolling":
                for replica in replicas:
                    await self._take_out(replica)
                    touched.append(replica)
                    methods[replica] = await self._update(replica, wset, version, token)
                    await self._verify(replica, version)
                    await self.fleet.set_routable(replica, True)
            else:
                await asyncio.gather(*(asyncio.to_thread(_pause, r) for r in replicas))
                touched.extend(replicas)
                try:
                    results = await asyncio.gather(
                        *(self._update(r, wset, version, token) for r in replicas)
                    )
                    methods = dict(zip(replicas, results))
                    for replica in replicas:
                        await self._verify(replica, version)
                finally:
                    await asyncio.gather(*(asyncio.to_thread(_resume, r) for r in replicas))
        except RolloutFailed as exc:
            await self._abort(version, touched, previous)
            raise RolloutFailed(exc.reason, exc.replica) from exc
        except Exception as exc:  # noqa: BLE001 - any failure means: put the old weights back
            await self._abort(version, touched, previous)
            raise RolloutFailed(f"{type(exc).__name__}: {exc}", touched[-1] if touched else None) from exc
        return RolloutReport(version, self.mode, replicas, previous, methods, time.perf_counter() - started)

    async def rollback(self, to_version: str | None = None) -> str:
        """Put every replica back on `to_version` (default: the version before the newest)."""
        versions = self.store.versions()
        target = to_version or (versions[-2] if len(versions) >= 2 else None)
        if target is None or not self.store.has(target):
            raise RolloutFailed(f"no checkpoint for version {target!r} to roll back to")
        replicas = [r.rstrip("/") for r in self.fleet.replicas()]
        await self._restore(replicas, {r: target for r in replicas})
        return target

    # --- steps
    async def _take_out(self, replica: str) -> None:
        await self.fleet.set_routable(replica, False)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while (n := await self.fleet.inflight(replica)) > 0:
            if time.monotonic() > deadline:
                raise RolloutFailed(f"drain timed out with {n} request(s) in flight", replica)
            await asyncio.sleep(0.2)

    async def _update(self, replica: str, wset: WeightSet, version: str, token: str) -> str:
        backend = await asyncio.to_thread(_backend, replica)
        if backend == "yieldgate":
            await asyncio.to_thread(
                push, wset, version, [replica], token=token, init=False, progress=False,
                config=self.config,
            )
            return "push"
        await asyncio.to_thread(reload_from_checkpoint, replica, self.store.path(version), version)
        return "reload"

    async def _verify(self, replica: str, version: str) -> None:
        client = EngineClient(replica, self.config.verify_timeout_s)
        try:
            if not await asyncio.to_thread(client.healthy):
                raise RolloutFailed("engine unhealthy after update", replica)
            served = await asyncio.to_thread(client.weight_version)
            if served != version:
                raise RolloutFailed(f"engine reports version {served!r}, expected {version!r}", replica)
        finally:
            client.close()
        if self.evaluate is not None and not await self.evaluate(replica):
            raise RolloutFailed("evaluation callback rejected the new weights", replica)

    async def _abort(self, version: str, touched: list[str], previous: dict[str, str]) -> None:
        await self._restore(touched, previous)
        if version not in previous.values():
            self.store.discard(version)

    async def _restore(self, replicas: list[str], previous: dict[str, str]) -> None:
        for replica in replicas:
            prev = previous[replica]
            try:
                await asyncio.to_thread(
                    reload_from_checkpoint, replica, self.store.path(prev), prev
                )
            except (BridgeError, httpx.HTTPError, ValueError) as exc:
                log.error("rollback of %s to %s failed: %s", replica, prev, exc)
                continue  # leave it out of routing: it serves unknown weights
            await self.fleet.set_routable(replica, True)

    async def _rotate_token(self, replicas: list[str]) -> str:
        token = make_push_token()
        for replica in replicas:
            if await asyncio.to_thread(_backend, replica) == "yieldgate":
                await asyncio.to_thread(_arm, replica, token, self.token)
        self.token = token
        return token

    def _ensure_checkpoint(self, version: str) -> None:
        if self.store.has(version):
            return
        if version == "default":
            # "default" is what vLLM reports before any update: the weights it launched with.
            self.store.adopt(version, self.store.base_model_dir)
            return
        log.warning("no checkpoint on disk for served version %r: rollback to it impossible", version)


def _version(url: str) -> str:
    with EngineClient(url, 30.0) as c:
        return c.weight_version()


def _backend(url: str) -> str | None:
    with EngineClient(url, 30.0) as c:
        return c.transfer_backend()


def _arm(url: str, token: str, current: str | None) -> None:
    info = {"token": token} if current is None else {"token": token, "current_token": current}
    with EngineClient(url, 60.0) as c:
        c.init_weight_transfer_engine(info)


def _pause(url: str) -> None:
    with EngineClient(url, 600.0) as c:
        c.pause("wait")


def _resume(url: str) -> None:
    with EngineClient(url, 60.0) as c:
        c.resume()


def default_store(base_model_dir: str | Path, config: BridgeConfig | None = None) -> CheckpointStore:
    import os

    cfg = config or BridgeConfig()
    root = cfg.checkpoint_root or os.path.join(
        os.environ.get("YIELDGATE_HOME") or os.path.expanduser("~/.cache/yieldgate"), "versions"
    )
    return CheckpointStore(root, base_model_dir, keep=cfg.keep_versions)
