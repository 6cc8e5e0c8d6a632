"""In-flight leases: how many requests hold a model version, and a wait for the last to let go.

A request takes a lease when it looks its version up and gives it back once answered (and counted); a
version that leaves is freed only once none is held. Event-loop only: no lock, no polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["InFlight"]


class InFlight:
    """A count of leases held, with an event set whenever it is zero."""

    def __init__(self) -> None:
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.count += 1
        self._idle.clear()

    def leave(self) -> None:
        if self.count <= 0:
            raise RuntimeError("a lease given back that was never taken")
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    @contextmanager
    def lease(self) -> Iterator[None]:
        self.enter()
        try:
            yield
        finally:
            self.leave()

    async def idle(self) -> None:
        """Return once no lease is held (at once when none is)."""
        await self._idle.wait()
