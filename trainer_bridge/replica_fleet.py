"""`FleetControl` over the serving fleet's replicas: what a rollout changes when the gateway
routes the traffic. Routable is the replica's `admitted`, in-flight the gateway's own count (a
drained replica has no request of ours left on it), a hold queues new requests in
`Fleet.wait_released`, and every step lands on the rollout's timeline under the replica's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from yieldgate.serving import BASE_VERSION, ENGINE_BASE_VERSION, EngineControl, Fleet, Replica
from .errors import InvalidWeightsRequest, RolloutConflict
from .schemas import RolloutState


def gateway_label(engine_version: str) -> str:
    return BASE_VERSION if engine_version == ENGINE_BASE_VERSION else engine_version


def engine_label(version: str) -> str:
    return ENGINE_BASE_VERSION if version == BASE_VERSION else version


async def engine_version(url: str) -> str:
    """The version an engine serves, as the gateway labels it."""
    async with EngineControl(url, 30.0) as engine:
        return gateway_label(await engine.weight_version())


class ReplicaFleet:
    def __init__(self, replicas: list[Replica], state: RolloutState, serving: Fleet | None = None,
                 forget_cached: Callable[[str], None] | None = None) -> None:
        """`serving`: the fleet whose requests an all-at-once hold queues; `forget_cached(name)`
        drops a replica's prefix-index entries (its engine reset its cache with the swap)."""
        self.by_url = {r.url: r for r in replicas}
        self.state = state
        self.serving = serving
        self.forget_cached = forget_cached
        self.verified: dict[str, str] = {}  # url -> engine version read by the rollout's verify
        # Engines whose weights this rollout touched: their prefix cache was reset with the swap,
        # so the prefix index forgets their blocks before they serve again.
        self.touched: set[str] = set()

    def replicas(self) -> Sequence[str]:
        return list(self.by_url)

    def tier(self, replica: str) -> str:
        return self.by_url[replica].tier

    def name(self, replica: str) -> str:
        r = self.by_url.get(replica)
        return r.name if r is not None else replica

    async def weight_version(self, replica: str) -> str:
        """The engine's version as last read or verified (the label every response carries)."""
        return engine_label(self.by_url[replica].weight_version)

    async def hold(self, replicas: Sequence[str]) -> None:
        if self.serving is not None:
            self.serving.hold()

    async def release(self, replicas: Sequence[str]) -> None:
        if self.serving is not None:
            self.serving.release()

    def note(self, event: str, replica: str = "", detail: str = "") -> None:
        self.state.note(event, self.name(replica) if replica else "", detail)

    def weights_changed(self, replica: str, verified: str | None) -> None:
        r = self.by_url[replica]
        if verified is None:
            self.touched.add(replica)
            self.verified.pop(replica, None)  # labelled from the engine again when admitted
            return
        # Labelled as soon as it verifies: an all-at-once swap's engines serve before `run` ends.
        self.verified[replica] = verified
        r.label_weights(gateway_label(verified))
        self.state.note("verified", r.name, gateway_label(verified))

    async def set_routable(self, replica: str, routable: bool) -> None:
        r = self.by_url[replica]
        if not routable:
            r.admitted = False
            self.state.note("drain", r.name, f"{r.inflight} in flight")
            return
        if replica in self.touched and self.forget_cached is not None:
            self.touched.discard(replica)
            # Without KV events the index would keep predicting hits on the reset cache.
            self.forget_cached(r.name)
        # Label first, admit second: every response from now on names the weights that made it.
        if replica in self.verified:
            r.label_weights(gateway_label(self.verified.pop(replica)))
        else:
            await self.sync_version(replica)
        r.admitted, r.note = True, ""
        self.state.note("admitted", r.name, r.weight_version)

    async def inflight(self, replica: str) -> int:
        return self.by_url[replica].inflight

    async def sync_version(self, replica: str) -> None:
        self.by_url[replica].label_weights(await engine_version(replica))


def replicas_to_update(fleet: Fleet, tier: str | None) -> list[Replica]:
    """The healthy replicas of `tier` (every tier: None) a weight change acts on."""
    tiers = fleet.tiers()
    if tier is not None and tier not in tiers:
        raise InvalidWeightsRequest(f"unknown tier {tier!r}; fleet has {tiers}", param="tier")
    picked = [r for r in fleet.replicas.values() if tier is None or r.tier == tier]
    if not any(r.healthy for r in picked):
        raise RolloutConflict("no healthy replica to update", code="no_replica")
    return [r for r in picked if r.healthy]
