"""What a replica source is (serving/discovery.py runs them): the protocol and its error."""

from __future__ import annotations

from typing import Protocol

from .config import ReplicaConfig


class DiscoveryError(Exception):
    """A lookup that gave no usable set of replicas. `reason` labels the metric."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason


class ReplicaSource(Protocol):
    tier: str
    label: str                    # shown as each replica's source, e.g. "dns:srv:_http._tcp.engines"

    async def resolve(self) -> list[ReplicaConfig]:
        """The replicas there are now; raises DiscoveryError when that cannot be told."""
        ...

    async def close(self) -> None:
        """Stop whatever the source runs in the background (a watch); most run nothing."""
        ...


def host_port(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
