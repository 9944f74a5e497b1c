"""The daemon's log records, watched in-process (the async daemon, fence and slim-daemon tests)."""

from __future__ import annotations

import asyncio
import logging

import pytest_asyncio


class LogWatch(logging.Handler):
    """Collects the daemon's log records; `wait` blocks (async) until one matches."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        super().__init__(logging.DEBUG)
        self.loop = loop
        self.records: list[logging.LogRecord] = []
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.loop.call_soon_threadsafe(self.changed.set)

    def messages(self, text: str) -> list[str]:
        return [m for r in self.records if text in (m := r.getMessage())]

    async def wait(self, text: str, timeout: float = 30) -> None:
        async def until() -> None:
            while not self.messages(text):
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(until(), timeout)


@pytest_asyncio.fixture
async def logs():
    """The daemon's log records, at DEBUG, for the test's event loop."""
    watch = LogWatch(asyncio.get_running_loop())
    logger = logging.getLogger("ckptd")
    old_level = logger.level
    logger.addHandler(watch)
    logger.setLevel(logging.DEBUG)
    yield watch
    logger.removeHandler(watch)
    logger.setLevel(old_level)
