"""Push post-trained weights into running vLLM engines: chunked, checksummed, versioned.

Engine side: the `yieldgate` weight-transfer backend (entry point `vllm.general_plugins:
yieldgate = trainer_bridge.plugin:register`), selected with
`--weight-transfer-config '{"backend":"yieldgate"}'`. Trainer side: `push()` and friends below;
`push_adapter()` for LoRA adapters (one checksummed upload to the gateway).
"""

from .adapter_push import AdapterPushReport, adapter_state, push_adapter

from .checkpoint import CheckpointStore, write_checkpoint
from .config import BridgeConfig
from .engine_client import EngineClient
from .history import WeightHistory
from .errors import (
    AdapterPushRefused,
    BridgeError,
    ChecksumMismatch,
    EngineRequestError,
    PushFailed,
    PushRefused,
    RolloutFailed,
    TransferError,
)
from .push import (
    PushFaults,
    PushReport,
    apply_staged,
    arm_engine,
    discard_staged,
    engine_weight_version,
    make_push_token,
    push,
    push_to_engine,
    reload_from_checkpoint,
    stage,
)
from .weights import WeightSet, checkpoint_name

__all__ = [
    "AdapterPushRefused",
    "AdapterPushReport",
    "adapter_state",
    "push_adapter",
    "BridgeConfig",
    "BridgeError",
    "CheckpointStore",
    "ChecksumMismatch",
    "EngineClient",
    "EngineRequestError",
    "PushFailed",
    "PushFaults",
    "PushRefused",
    "PushReport",
    "RolloutFailed",
    "TransferError",
    "WeightHistory",
    "WeightSet",
    "apply_staged",
    "arm_engine",
    "checkpoint_name",
    "discard_staged",
    "engine_weight_version",
    "make_push_token",
    "push",
    "push_to_engine",
    "reload_from_checkpoint",
    "stage",
    "write_checkpoint",
]
