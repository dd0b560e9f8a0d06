"""A replica's weight label against the health checker's version re-read.

A replica that comes back healthy has its version read from the engine (`/weight_info`). That
read can straddle a rollout's swap: asked before the engine took the new weights, answered after
the rollout verified them and labelled the replica. Its stale answer must not relabel the
replica, or every response from then on names the old weights while the new ones serve.

An engine stand-in whose `/weight_info` answer the test holds back makes the interleaving
certain: a real engine would need the race to land by chance (a CI run once did).
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from yieldgate.serving.config import FleetConfig, ReplicaConfig
from yieldgate.serving.fleet import Fleet
from yieldgate.trainer_bridge.replica_fleet import ReplicaFleet
from yieldgate.trainer_bridge.schemas import RolloutState


class HeldEngine:
    """/health and /metrics answer at once; /weight_info answers "default" (base) once `answer`
    is set."""

    def __init__(self) -> None:
        self.asked = asyncio.Event()
        self.answer = asyncio.Event()
        self.answer.set()
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/weight_info", self.weight_info)
        app.router.add_get("/metrics", self.health)
        self.runner = web.AppRunner(app)

    async def health(self, _request: web.Request) -> web.Response:
        return web.Response()

    async def weight_info(self, _request: web.Request) -> web.Response:
        self.asked.set()
        await self.answer.wait()
        return web.json_response({"weight_version": "default"})

    async def start(self) -> str:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]


def test_a_probe_read_from_before_a_swap_does_not_relabel_the_swapped_replica():
    async def main() -> tuple[str, bool]:
        engine = HeldEngine()
        url = await engine.start()
        # No background probing: the test drives every probe itself.
        fleet = Fleet(FleetConfig(model="demo", health_interval_s=3600, scrape_interval_s=3600,
                                  replicas=[ReplicaConfig(name="r0", url=url)]))
        await fleet.start()
        replica = fleet.replicas["r0"]
        try:
            assert replica.healthy and replica.weight_version == "base"
            fleet.set_health(replica, False)  # e.g. one probe hit a connection the engine dropped

            # The next probe finds it healthy again and asks its version: the engine reads it
            # before the swap commits; the answer is held back.
            engine.answer.clear()
            engine.asked.clear()
            probe = asyncio.create_task(fleet.check_health())
            await engine.asked.wait()

            # Meanwhile the rollout swaps the replica, verifies "wr-1" on it, labels and admits it.
            state = RolloutState(id="ro_test", kind="rollout", version="wr-1", source="push",
                                 mode="rolling", tiers=["standard"])
            rollout_fleet = ReplicaFleet([replica], state, fleet)
            await rollout_fleet.set_routable(url, False)
            rollout_fleet.verified[url] = "wr-1"
            await rollout_fleet.set_routable(url, True)
            assert replica.weight_version == "wr-1"

            engine.answer.set()  # the probe's stale answer arrives last
            await probe
            return replica.weight_version, replica.routable
        finally:
            await fleet.close()
            await engine.runner.cleanup()

    version, routable = asyncio.run(main())
    assert routable
    assert version == "wr-1"
