"""The `yieldgate` weight-transfer backend: the engine-side half, loaded inside vLLM workers.

vLLM drives it through its dev-mode weight-transfer endpoints. An update streams verified chunks
into registered staging memory (a memfd a same-host trainer writes into directly) and loads each
parameter once complete; it can be staged while serving and applied later on a drained engine.
Any failure puts the snapshot of the old weights back before the engine serves again. See
docs/weights.md.
"""

from __future__ import annotations

import hmac
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.logger import init_logger

from . import wire
from .errors import ChecksumMismatch, PushRefused, TransferError
from .receiver import ParamLayout, StagingArea, StagingPool, receive_update
from .snapshot import ModelSnapshot

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.weight_transfer import WeightTransferConfig

# vLLM only attaches its handler to the "vllm" logger tree; under it, our lines reach the engine log.
logger = init_logger(f"vllm.{__name__}")

BACKEND = "yieldgate"


# vLLM builds these with `cls(**payload)`, so they are dataclasses rather than msgspec Structs.
@dataclass
class YieldgateInitInfo(WeightTransferInitInfo):
    """Arms the receiver with the push token. Replacing an armed token needs the current one."""

    token: str
    current_token: str | None = None
    nccl: dict[str, Any] | None = None  # NCCLWeightTransferInitInfo fields, CUDA trainers only


@dataclass
class YieldgateUpdateInfo(WeightTransferUpdateInfo):
    """Parameter metadata for one transaction plus where to pull the chunk stream from."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sender: str = ""  # "host:port" of the trainer's chunk server
    session: str = ""  # hex nonce; binds this stream to this request
    checksum: str = "crc32"
    timeout_s: float = 60.0
    transport: str = "tcp"  # "tcp" | "nccl"
    phase: str = "load"  # "load": receive, verify, load | "stage": in the background | "apply"
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        if self.phase not in ("load", "stage", "apply"):
            raise ValueError(f"unknown phase {self.phase!r}")


class _StagedUpdate:
    """An update being received in the background ("stage"), applied later ("apply")."""

    def __init__(self, session: str, staging: StagingArea) -> None:
        self.session = session
        self.staging = staging
        self.error: BaseException | None = None
        self.seconds = 0.0
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self, receive: Any) -> None:
        def run() -> None:
            t0 = time.perf_counter()
            try:
                receive(self)
            except BaseException as exc:  # noqa: BLE001 - surfaced by wait()
                self.error = exc
                self.staging.fail(exc)
            self.seconds = time.perf_counter() - t0

        self._thread = threading.Thread(target=run, name="yieldgate-stage", daemon=True)
        self._thread.start()

    def on_socket(self, sock: socket.socket) -> None:
        self._sock = sock

    def wait(self, timeout_s: float) -> None:
        assert self._thread is not None
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.cancel()
            raise TransferError(f"staged update still receiving after {timeout_s:.0f}s")
        if self.error is not None:
            raise self.error

    def close(self, grace_s: float = 0.0) -> None:
        """Let the receive thread finish for up to `grace_s` (it may still be telling the sender
        why the stream failed), then cancel whatever is left."""
        if self._thread is not None:
            self._thread.join(grace_s)
        self.cancel()

    def cancel(self) -> None:
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # unblocks recv_into in the stage thread
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(10.0)


class YieldgateWeightTransferEngine(WeightTransferEngine[YieldgateInitInfo, YieldgateUpdateInfo]):
    init_info_cls = YieldgateInitInfo
    update_info_cls = YieldgateUpdateInfo

    def __init__(
        self,
        config: WeightTransferConfig,
        vllm_config: VllmConfig,
        device: torch.device,
        model: torch.nn.Module,
    ) -> None:
        super().__init__(config, vllm_config, device, model)
        self._token: str | None = None
        self._nccl: WeightTransferEngine | None = None
        self._pool = StagingPool()
        self._staged: _StagedUpdate | None = None
        self.updates_applied = 0

    def init_transfer_engine(self, init_info: YieldgateInitInfo) -> None:
        if not init_info.token:
            raise PushRefused("init_info.token must be a non-empty string")
        if self._token is not None and not hmac.compare_digest(self._token, init_info.token):
            # Rotating to a new rollout token: only whoever holds the current one may do it.
            if init_info.current_token is None or not hmac.compare_digest(
                self._token, init_info.current_token
            ):
                raise PushRefused("engine already armed with another push token")
        self._token = init_info.token
        if init_info.nccl is not None:
            self._init_nccl(init_info.nccl)
        logger.info("yieldgate weight transfer armed")

    def start_weight_update(self) -> None:
        # Non-destructive: staging happens inside update_weights, so a session that is abandoned
        # here costs nothing. A stale staged update from an abandoned session is dropped.
        self._discard_staged()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        typed = self.parse_update_info(update_info)
        self.receive_weights(typed)
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: YieldgateUpdateInfo) -> None:
        if update_info.transport == "nccl":
            self._receive_nccl(update_info)
            return
        if self._token is None:
            raise PushRefused("engine not armed: call /init_weight_transfer_engine with a token")
        if update_info.phase == "apply":
            self._apply_staged(update_info)
            return
        self._discard_staged()
        staged = _StagedUpdate(update_info.session, self._staging(update_info))
        token = self._token

        def receive(update: _StagedUpdate) -> None:
            receive_update(
                update_info.sender,
                bytes.fromhex(update_info.session),
                token,
                update.staging,
                update_info.checksum,
                update_info.timeout_s,
                on_socket=update.on_socket,
            )

        staged.start(receive)
        if update_info.phase == "stage":
            # Returns at once: the engine keeps serving while the chunks land and are verified.
            self._staged = staged
            return
        try:
            if not update_info.extra.get("pipeline", True):
                staged.wait(update_info.timeout_s)  # the whole stream verified before any load
            self._load_staged(staged, update_info.timeout_s)
        except BaseException:
            # A stream failure: its thread is sending the reason; a load failure: stop the stream.
            staged.close(grace_s=5.0 if staged.error is not None or staged.staging.failed else 0.0)
            raise
        staged.close()  # the receive thread is done (staged.wait succeeded)

    def _staging(self, update_info: YieldgateUpdateInfo) -> StagingArea:
        layout = [
            ParamLayout(n, wire.parse_dtype(d), tuple(s))
            for n, d, s in zip(update_info.names, update_info.dtype_names, update_info.shapes)
        ]
        return StagingArea(layout, self._pool)

    def _apply_staged(self, update_info: YieldgateUpdateInfo) -> None:
        staged, self._staged = self._staged, None
        if staged is None or not hmac.compare_digest(staged.session, update_info.session):
            if staged is not None:
                staged.cancel()
            raise TransferError("no staged update for this session: stage it first")
        staged.wait(update_info.timeout_s)
        self._load_staged(staged, update_info.timeout_s)

    def _load_staged(self, staged: _StagedUpdate, timeout_s: float) -> None:
        """Load each parameter once it is verified (all at once if staging already finished);
        on any failure, the old weights are restored before this returns."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        t0 = time.perf_counter()
        staging, items = staged.staging, staged.staging.items()
        snapshot = ModelSnapshot(self.model)
        snapshot_s = time.perf_counter() - t0
        applied, waited = 0, 0.0
        # The layerwise-reload lifecycle is what vLLM's own reload uses: it re-runs any
        # post-load processing (quantization, repacking) per layer, once all its tensors are in.
        initialize_layerwise_reload(self.model)
        try:
            while applied < len(items):
                t_wait = time.perf_counter()
                ready = staging.wait_ready(applied, timeout_s)
                waited += time.perf_counter() - t_wait
                self.model.load_weights(
                    (n, t.to(self.device, non_blocking=True)) for n, t in items[applied:ready]
                )
                applied = ready
            staged.wait(timeout_s)  # the stream's own end: status sent, no error
            finalize_layerwise_reload(self.model, self.model_config)
        except BaseException as exc:
            try:
                finalize_layerwise_reload(self.model, self.model_config)
            finally:
                snapshot.restore()
            logger.warning(
                "yieldgate: update failed after %d of %d tensors were loaded (%s); old weights restored",
                applied, len(items), exc,
            )
            restored = f"engine restored its previous weights after loading {applied} of {len(items)} tensors"
            if isinstance(exc, (ChecksumMismatch, PushRefused, TransferError)):
                # The HTTP answer carries only the message: say there what the engine did.
                raise type(exc)(f"{exc}; {restored}") from exc
            if isinstance(exc, Exception):
                exc.add_note(restored)
            raise
        self.updates_applied += 1
        logger.info(
            "yieldgate: %d tensors (%.1f MB) received+verified in %.3fs, loaded in %.3fs "
            "(%.3fs waiting for chunks; snapshot %.1f MB in %.3fs)",
            len(staging.layout),
            staging.total_bytes / 1e6,
            staged.seconds,
            time.perf_counter() - t0,
            waited,
            snapshot.nbytes / 1e6,
            snapshot_s,
        )

    def _discard_staged(self) -> None:
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.cancel()

    def finish_weight_update(self) -> None:
        # A staged update nobody applied (an aborted rollout) is dropped, never loaded later.
        self._discard_staged()

    def shutdown(self) -> None:
        self._discard_staged()
        self._pool.release()
        if self._nccl is not None:
            self._nccl.shutdown()
            self._nccl = None

    # --- CUDA only: tensors that already live on GPUs travel by NCCL, not TCP. Untested here.
    def _init_nccl(self, fields: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        self._nccl = NCCLWeightTransferEngine(self.config, self.vllm_config, self.device, self.model)
        self._nccl.init_transfer_engine(self._nccl.parse_init_info(fields))

    def _receive_nccl(self, update_info: YieldgateUpdateInfo) -> None:
        if self._nccl is None:
            raise RuntimeError("NCCL transport requested but init_info carried no nccl fields")
        self._nccl.start_weight_update()
        self._nccl.update_weights(
            {"names": update_info.names, "dtype_names": update_info.dtype_names, "shapes": update_info.shapes}
        )
        self._nccl.finish_weight_update()
