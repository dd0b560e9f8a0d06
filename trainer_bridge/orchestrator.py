"""The weight orchestrator: the parts that change the weights a gateway's fleet serves, built
over narrow inputs and wired together once.

Inputs: the serving `Fleet` (replicas, hold/release, the restore hook), `forget_cached(name)`
(the prefix index drops a replica's blocks), the served model's name and where its launch
weights are. It imports nothing from the gateway or any web framework; the gateway's weights
routes call its parts and map their errors (`WeightsRequestError`) to HTTP.

    book      RolloutBook      the current rollout, the ones before it, the checkpoint store
    arming    EngineArming     the engines' push token and which engines hold it
    dtype     ServingDtype     the engines' serving dtype (pushes stream in it)
    rollouts  WeightRollouts   rollouts from a push or a checkpoint, rollbacks
    pushes    PushIntakes      a trainer's push, from its first call to its rollout
    restores  EngineRestore    a restarted engine's weights put back from the store
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from yieldgate.serving import Fleet
from .background import BackgroundTasks
from .checkpoint import CheckpointStore
from .config import BridgeConfig
from .engine_arming import EngineArming
from .engine_restore import EngineRestore
from .push_intakes import PushIntakes
from .replica_fleet import gateway_label
from .rollout_book import RolloutBook
from .serving_dtype import ServingDtype
from .weight_rollouts import WeightRollouts


class WeightOrchestrator:
    def __init__(self, fleet: Fleet, *, root: Path, model: str, model_dir: Callable[[], str],
                 forget_cached: Callable[[str], None], bridge: BridgeConfig | None = None) -> None:
        """`root`: where the store and the push token live; `model`: the name the engines serve
        (a canary asks for it); `model_dir()`: the launch weights (asked at the store's first
        use: the demo model may have to be generated); `forget_cached(name)`: drop a replica's
        prefix-index entries (its engine's cache is empty after a swap or a restart)."""
        bridge = bridge or BridgeConfig()
        self.fleet = fleet
        self.model_dir = model_dir
        self.tasks = BackgroundTasks()
        self.book = RolloutBook(fleet, lambda: CheckpointStore(root / "versions", model_dir(),
                                                               keep=bridge.keep_versions))
        self.arming = EngineArming(root)
        self.dtype = ServingDtype(fleet, self.tasks)
        self.rollouts = WeightRollouts(fleet, self.book, self.arming, self.tasks, model=model,
                                       forget_cached=forget_cached, bridge=bridge)
        self.pushes = PushIntakes(fleet, self.book, self.rollouts, self.arming, self.tasks, bridge)
        self.restores = EngineRestore(self.book, self.arming, forget_cached=forget_cached,
                                      bridge=bridge)

    def start(self) -> None:
        self.fleet.restore = self.restores.restore
        self.dtype.warm()

    async def close(self) -> None:
        await self.tasks.close()

    def snapshot(self) -> dict[str, Any]:
        """GET /admin/weights: what each replica serves, the current rollout and the ones before."""
        return {
            "replicas": {r.name: {"tier": r.tier, "url": r.url, "weight_version": r.weight_version,
                                  "healthy": r.healthy, "admitted": r.admitted, "inflight": r.inflight}
                         for r in self.fleet.replicas.values()},
            "rollout": self.book.current,
            "history": self.book.history[-10:],
            "versions": [gateway_label(v) for v in self.book.store.versions()],  # what the store holds
            # What each replica served and how it ended; what a rollback would return to now.
            "weight_history": self.book.weight_history(),
            "rollback_to": self.book.rollback_targets(),
            "dtype": self.dtype.value,  # the engines' serving dtype (pushes stream in it); null until known
        }
