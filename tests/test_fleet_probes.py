"""serving.fleet's health probes and metrics scrapes against an engine stand-in: an engine that
goes away is ejected at the next probe, and a /metrics page that is not Prometheus text (or not a
200) is skipped instead of stopping the gateway's start."""

from __future__ import annotations

import asyncio

from yieldgate.serving.config import FleetConfig, ReplicaConfig
from yieldgate.serving.fleet import Fleet


class Engine:
    """Answers GET /health with 200, GET /metrics with whatever `metrics` holds (status, body)."""

    def __init__(self) -> None:
        self.metrics: tuple[int, bytes] = (200, b"")
        self.server: asyncio.base_events.Server | None = None
        self.writers: set[asyncio.StreamWriter] = set()

    async def die(self) -> None:
        """Stop listening and drop every connection, as a killed engine does."""
        self.server.close()
        for writer in list(self.writers):
            writer.close()
        await self.server.wait_closed()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ")[1]
                status, body = self.metrics if path == b"/metrics" else (200, b"")
                writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.writers.discard(writer)
            writer.close()


def fleet_for(url: str) -> Fleet:
    # No background loops: each test probes and scrapes itself.
    return Fleet(FleetConfig(model="demo", health_interval_s=3600, scrape_interval_s=3600,
                             replicas=[ReplicaConfig(name="r0", url=url)]))


def test_a_refused_connection_ejects_at_once():
    async def main() -> tuple[bool, bool]:
        engine = Engine()
        url = await engine.start()
        fleet = fleet_for(url)
        await fleet.start()
        replica = fleet.replicas["r0"]
        before = replica.healthy
        await engine.die()
        try:
            await fleet.check_health()
            return before, replica.healthy
        finally:
            await fleet.close()

    assert asyncio.run(main()) == (True, False)


def test_metrics_that_are_not_prometheus_text_do_not_stop_the_fleet():
    async def main() -> list[dict[str, float]]:
        engine = Engine()
        fleet = fleet_for(await engine.start())
        seen = []
        try:
            for metrics in [(404, b"Not Found"), (200, b"<html>{{{ not metrics"),
                            (200, b"vllm:num_requests_running 3\n")]:
                engine.metrics = metrics
                if fleet._session is None:
                    await fleet.start()  # starts with a scrape: must not raise
                else:
                    await fleet.scrape()
                seen.append(dict(fleet.replicas["r0"].engine_metrics))
        finally:
            await fleet.close()
            engine.server.close()
        return seen

    assert asyncio.run(main()) == [{}, {}, {"vllm:num_requests_running": 3.0}]
