"""`vllm.general_plugins` entry point: registers the `yieldgate` weight-transfer backend.

vLLM loads general plugins in every process (API server, engine core, workers), possibly more
than once, so registration must be idempotent; modules are registered by path so the engine
only imports them when `--weight-transfer-config '{"backend":"yieldgate"}'` selects them.
"""

from __future__ import annotations

BACKEND = "yieldgate"


def register() -> None:
    from vllm.distributed.weight_transfer.factory import (
        WeightTransferEngineFactory,
        WeightTransferTrainerFactory,
    )

    for factory, module, cls in (
        (WeightTransferEngineFactory, "yieldgate.trainer_bridge.engine", "YieldgateWeightTransferEngine"),
        (WeightTransferTrainerFactory, "yieldgate.trainer_bridge.trainer_engine", "YieldgateTrainerWeightTransferEngine"),
    ):
        try:
            factory.register_engine(BACKEND, module, cls)
        except ValueError:
            pass  # already registered in this process
