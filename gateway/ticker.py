"""A coroutine run every few seconds in the background of the gateway until it is closed."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable


class Ticker:
    def __init__(self, name: str, interval_s: float, tick: Callable[[], Awaitable[None]]):
        self.name, self.interval_s, self.tick = name, interval_s, tick
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name=self.name)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.tick()
