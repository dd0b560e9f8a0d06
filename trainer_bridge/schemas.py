"""The weights admin API's wire schemas (what a trainer or an operator sends) and the state of a
rollout as `GET /admin/weights` shows it."""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from yieldgate.serving import BASE_VERSION, ENGINE_BASE_VERSION
from . import wire

RESERVED_VERSIONS = (BASE_VERSION, ENGINE_BASE_VERSION)

Version = Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]


class Canary(msgspec.Struct, forbid_unknown_fields=True):
    """A greedy completion each updated replica must pass before it is re-admitted."""

    prompt: Annotated[str, Meta(min_length=1, max_length=8192)]
    expect_substring: str
    max_tokens: Annotated[int, Meta(ge=1, le=256)] = 16


class CheckpointSource(msgspec.Struct, forbid_unknown_fields=True):
    checkpoint: str


class WeightsRequest(msgspec.Struct, forbid_unknown_fields=True):
    version: Version | None = None         # required for a checkpoint; a push may name it at finish
    source: Literal["push"] | CheckpointSource = "push"
    mode: Literal["rolling", "all_at_once"] = "rolling"
    tier: str | None = None                 # None = every tier
    canary: Canary | None = None
    wait: bool = False                      # checkpoint: answer only once the rollout ended


class PushStream(msgspec.Struct, forbid_unknown_fields=True):
    """What a trainer streams and where from: the update info every receiver of the push gets,
    less the session (one per receiver, chosen by the gateway)."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]
    sender: Annotated[str, Meta(min_length=3, max_length=300)]  # "host:port" of its chunk server
    checksum: str = "crc32"
    timeout_s: Annotated[float, Meta(gt=0, le=3600)] = 60.0
    extra: dict[str, Any] = {}

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError("names, dtype_names and shapes must have the same length")
        if self.checksum not in wire.CHECKSUMS:
            raise ValueError(f"unsupported checksum {self.checksum!r}")


class PushAnnounce(msgspec.Struct, forbid_unknown_fields=True):
    """`POST /admin/weights/push`: open (or take up) a push and start every receiver pulling the
    trainer's stream, in one round trip instead of targets + init + start + update."""

    version: Version
    stream: PushStream
    mode: Literal["rolling", "all_at_once"] = "rolling"
    tier: str | None = None


class RollbackRequest(msgspec.Struct, forbid_unknown_fields=True):
    to: Version | None = None              # None = what each replica served before (history)
    to_version: Version | None = None      # older spelling of `to`
    tier: str | None = None


class TimelineEvent(msgspec.Struct):
    t: float                                # unix seconds
    event: str                              # issued, pushed, drain, updated, admitted, failed, ...
    replica: str = ""
    detail: str = ""


class RolloutState(msgspec.Struct):
    id: str
    kind: Literal["rollout", "rollback", "restore"]  # restore: a restarted engine gets its weights back
    version: str
    source: str                             # "push" | "checkpoint:<path>" | "store"
    mode: str
    tiers: list[str]
    state: Literal["awaiting_push", "running", "succeeded", "failed"] = "running"
    reason: str = ""
    failed_replica: str = ""
    started_at: float = msgspec.field(default_factory=time.time)
    finished_at: float | None = None
    timeline: list[TimelineEvent] = []

    def note(self, event: str, replica: str = "", detail: str = "") -> None:
        self.timeline.append(TimelineEvent(time.time(), event, replica, detail))

