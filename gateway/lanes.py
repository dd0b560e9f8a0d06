"""Lanes behind interactive traffic (docs/batch.md): flex requests and batch lines are served by
the standard tier's engines at a lower vLLM priority, and enter only where there is headroom,
read from the signals the fleet already scrapes (each engine's waiting queue) and this gateway's
own requests in flight. Interactive requests never pass through here.
"""

from __future__ import annotations

import math

from yieldgate.serving import Fleet, Replica

from .config import LaneConfig
from .errors import TooManyRequests
from .tiers import BATCH, FLEX


class FlexUnavailable(TooManyRequests):
    """OpenAI's answer when flex capacity is short: 429, try again later."""

    code = "resource_unavailable"


class Lanes:
    def __init__(self, config: LaneConfig, fleet: Fleet):
        self.config = config
        self.fleet = fleet
        self._priority = {FLEX: config.flex_priority, BATCH: config.batch_priority} if config.priority else {}

    def priority(self, lane: str) -> int:
        """The engine priority of a lane's requests (0: none sent)."""
        return self._priority.get(lane, 0)

    def admit_flex(self, tier: str) -> None:
        """FlexUnavailable (429, retry-after) when every replica of `tier` has a waiting queue past
        lanes.flex_max_waiting: a flex request that cannot be served soon is told so at once."""
        replicas = self.fleet.candidates(tier)
        limit = self.config.flex_max_waiting
        if replicas and all(r.num_waiting > limit for r in replicas):
            waiting = min(r.num_waiting for r in replicas)
            raise FlexUnavailable(
                f"Flex capacity is unavailable: every replica has more than {limit} requests waiting "
                f"(fewest: {waiting:.0f}). Retry later, or send the request without service_tier 'flex'.",
                headers={"retry-after": str(max(1, math.ceil(self.config.flex_retry_after_s)))})

    def batch_room(self, tier: str, running: int) -> int:
        """How many more batch lines this gateway may start on `tier` now: batch_lines_per_replica
        for each replica whose engine's queue is short enough, less the `running` lines of ours."""
        open_replicas = sum(1 for r in self.fleet.candidates(tier) if self._has_headroom(r))
        return max(0, open_replicas * self.config.batch_lines_per_replica - running)

    def _has_headroom(self, replica: Replica) -> bool:
        return replica.num_waiting <= self.config.batch_max_waiting
