"""When the server's event loop last had nothing to do: what tells a request that came alone from one that
waited behind another.

A request computed on the event loop's own thread (`DynamicBatcher`'s inline rule) blocks the loop, and
requests that arrive meanwhile wait in gRPC's queue, unseen. Each is then handled the moment the loop is
free, finds the server idle, and would be computed inline in turn: one core serving a concurrent load
(seq 16 at c32 went from 1,591 to 807 requests/s so). Arrival times cannot tell them apart: a waiting
request is stamped when the loop reaches it, a few hundred microseconds after the computation ended, which
a client's round trip on loopback also is. The loop itself can: between a request that came alone and the
one before it, the loop waited in its selector for the network; between two that queued, it never did.

`IdleSelector` is the server loop's selector (`new_event_loop`); it notes when a wait in it ended. The note
is the loop's own (`IdleLoop`), so servers on different loops, in one process, each read their own.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from typing import Any

__all__ = ["IDLE_WAIT_S", "IdleLoop", "IdleSelector", "last_idle", "new_event_loop"]

# A select that took this long waited for something to happen: the loop had nothing to do. One with work
# already pending returns within a few microseconds.
IDLE_WAIT_S = 50e-6


class IdleSelector(selectors.DefaultSelector):
    """The platform's default selector, noting when the event loop last came out of a wait."""

    def __init__(self) -> None:
        super().__init__()
        self.idle_at = 0.0  # time.monotonic() when the latest wait ended

    def select(self, timeout: float | None = None) -> list[tuple[Any, int]]:
        if timeout is not None and timeout <= 0:  # work is pending: this is no wait
            return super().select(timeout)
        start = time.monotonic()
        events: list[tuple[Any, int]] = super().select(timeout)
        end = time.monotonic()
        if end - start >= IDLE_WAIT_S:
            self.idle_at = end
        return events


class IdleLoop(asyncio.SelectorEventLoop):
    """A selector event loop on an `IdleSelector`: it knows when it last waited for work."""

    def __init__(self) -> None:
        self.idle_selector = IdleSelector()
        super().__init__(self.idle_selector)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The server's event loop (asyncio.Runner's loop_factory): a selector loop whose waits are noted."""
    return IdleLoop()


def last_idle() -> float | None:
    """time.monotonic() when the running loop last waited for work; None when it notes no waits (a loop
    `new_event_loop` did not make, uvloop's for one: then nothing is known, and no request is taken for one
    that waited behind another)."""
    loop = asyncio.get_running_loop()
    return loop.idle_selector.idle_at if isinstance(loop, IdleLoop) else None
