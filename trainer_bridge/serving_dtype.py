"""The dtype the engines serve in (a push streams its weights in it), asked once per gateway."""

from __future__ import annotations

import asyncio

from yieldgate.serving import EngineControl, Fleet
from .background import BackgroundTasks


class ServingDtype:
    def __init__(self, fleet: Fleet, tasks: BackgroundTasks) -> None:
        self.fleet = fleet
        self.tasks = tasks
        self.value: str | None = None  # null until known
        self._asked: asyncio.Future | None = None

    def warm(self) -> None:
        """Ask as soon as a replica is up, not at the first push: an engine's first /server_info
        runs vLLM's environment collection (seconds; over 10 on a busy box)."""
        self.tasks.spawn(self._warm())

    async def _warm(self) -> None:
        while not any(r.healthy for r in self.fleet.replicas.values()):
            await asyncio.sleep(0.5)
        await self.ask()

    async def ask(self) -> str | None:
        """Every replica serves the same model, so one answer holds for all; a caller arriving
        while it is being asked waits for that answer."""
        if self.value is None:
            if self._asked is None or self._asked.done():
                self._asked = self.tasks.spawn(self._ask())
            await asyncio.shield(self._asked)
        return self.value

    async def _ask(self) -> None:
        for r in self.fleet.replicas.values():
            if r.healthy:
                async with EngineControl(r.url, 30.0) as engine:
                    self.value = await engine.serving_dtype()
                return
