"""When the server's event loop last had nothing to do: what tells a request that came alone from one that
waited behind another.

A request computed on the event loop's own thread (`DynamicBatcher`'s inline rule) blocks the loop, and
requests that arrive meanwhile wait in gRPC's queue, unseen. Each is then handled the moment the loop is
free, finds the server idle, and would be computed inline in turn: one core serving a concurrent load
(seq 16 at c32 went from 1,591 to 807 requests/s so). Arrival times cannot tell them apart: a waiting
request is stamped when the loop reaches it, a few hundred microseconds after the computation ended, which
a client's round trip on loopback also is. The loop itself can: between a request that came alone and the
one before it, the loop waited in its selector for the network; between two that queued, it never did.

`IdleSelector` is the server loop's selector (`new_event_loop`); it notes when a wait in it ended.
"""

from __future__ import annotations

import asyncio
import selectors
import time
import weakref
from typing import Any

__all__ = ["IDLE_WAIT_S", "IdleSelector", "last_idle", "new_event_loop"]

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


_selectors: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, IdleSelector] = weakref.WeakKeyDictionary()


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The server's event loop (asyncio.Runner's loop_factory): a selector loop whose waits are noted."""
    selector = IdleSelector()
    loop = asyncio.SelectorEventLoop(selector)
    _selectors[loop] = selector
    return loop


def last_idle() -> float | None:
    """time.monotonic() when the running loop last waited for work; None when it notes no waits (a loop
    `new_event_loop` did not make: then nothing is known)."""
    selector = _selectors.get(asyncio.get_running_loop())
    return selector.idle_at if selector is not None else None
