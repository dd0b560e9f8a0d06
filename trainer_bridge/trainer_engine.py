"""The `yieldgate` backend's trainer-side twin, for code written against vLLM's
`WeightTransferTrainerFactory` (the same shape as vLLM's NCCL / IPC trainer engines).

    engine = WeightTransferTrainerFactory.trainer_init(
        YieldgateTrainerInitInfo(rank=0, token=TOKEN), client=EngineClient(url), source=ModuleSource(model))
    engine.send_weights()

CPU tensors (and CUDA tensors by default) travel over the chunked TCP stream. With `nccl=`
fields the CUDA path delegates to vLLM's own NCCL trainer engine (small, untested here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import (
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
)

from concurrent.futures import ThreadPoolExecutor

from .config import BridgeConfig
from .sender import ChunkSender, StreamTarget
from .weights import WeightEntry, WeightSet


@dataclass
class YieldgateTrainerInitInfo(TrainerInitInfo):
    backend: ClassVar[str] = "yieldgate"

    token: str
    chunk_bytes: int = BridgeConfig().chunk_bytes
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None
    nccl: dict[str, Any] | None = None  # NCCLTrainerInitInfo fields (CUDA only)


class _NcclClientAdapter:
    """Wraps the control-plane client so vLLM's NCCL trainer engine talks to a yieldgate engine."""

    def __init__(self, client: VLLMWeightSyncClient, token: str) -> None:
        self.client = client
        self.token = token

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine({"token": self.token, "nccl": init_info})

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights({**update_info, "transport": "nccl"})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)


class YieldgateTrainerWeightTransferEngine(TrainerWeightTransferEngine[YieldgateTrainerInitInfo]):
    init_info_cls = YieldgateTrainerInitInfo

    def __init__(self, *, client: VLLMWeightSyncClient, source: WeightSource | None = None,
                 is_sender: bool = True, init_info: YieldgateTrainerInitInfo) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.init_info = init_info
        self._nccl: TrainerWeightTransferEngine | None = None

    @classmethod
    def trainer_init(
        cls,
        init_info: YieldgateTrainerInitInfo,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource | None = None,
    ) -> Self:
        if source is None:
            raise ValueError("the yieldgate trainer engine needs a WeightSource")
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, init_info=init_info)
        if not engine.is_sender:
            return engine
        if init_info.nccl is not None:
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            engine._nccl = NCCLTrainerWeightTransferEngine.trainer_init(
                NCCLTrainerInitInfo(rank=init_info.rank, **init_info.nccl),
                client=_NcclClientAdapter(client, init_info.token),
                source=source,
            )
        else:
            client.init_weight_transfer_engine({"token": init_info.token})
        return engine

    def send_weights(self, weight_version: str | None = None) -> None:
        assert self.source is not None
        if self._nccl is not None:
            self._nccl.send_weights()
            return
        if not self.is_sender:
            for _ in self.source:  # keep the trainer-side gathers in lockstep
                pass
            return
        weights = WeightSet(
            [WeightEntry(m.name, t, m.dtype) for m, (_, t) in zip(self.source.metadata(), self.source)]
        )
        self.client.start_weight_update()
        with ChunkSender(self.init_info.bind_host, self.init_info.advertise_host,
                         self.init_info.chunk_bytes) as sender:
            target = StreamTarget(token=self.init_info.token)
            info = sender.update_info(weights, target, BridgeConfig().stream_timeout_s)

            def update() -> None:
                try:
                    self.client.update_weights(info)
                except Exception as exc:
                    target.fail(exc)  # unblocks the stream if the engine never dials in
                    raise

            with ThreadPoolExecutor(1) as pool:
                fut = pool.submit(update)
                sender.stream(weights, [target])
                fut.result()
            if target.error is not None:
                raise target.error
        self.client.finish_weight_update(weight_version)

    def shutdown(self) -> None:
        if self._nccl is not None:
            self._nccl.shutdown()
