"""Per-tier routing: the gateway's adapter to the policies in `cache`."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

from serving.fleet import Fleet, Replica


@dataclass(slots=True)
class Decision:
    replica: Replica
    predicted_cached_tokens: int = 0


class Routing:
    def __init__(self, fleet: Fleet):
        self.fleet = fleet
        self._counter = itertools.count()

    def pick(self, ctx: Any, typed: Any, candidates: Sequence[Replica]) -> Decision:
        # Fewest in-flight requests; ties broken round-robin.
        n = next(self._counter)
        best = min(range(len(candidates)),
                   key=lambda i: (candidates[i].inflight, (i - n) % len(candidates)))
        return Decision(candidates[best])

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass
