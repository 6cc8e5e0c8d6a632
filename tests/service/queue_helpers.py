"""What the scheduler tests share: an observer that records, and a wait for a condition."""

from __future__ import annotations

import asyncio
import time
from typing import Any


class Recorder:
    """A BatchObserver that keeps what the scheduler reports."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []  # rows, padded tokens, real tokens
        self.drops: list[str] = []

    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...

    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None:
        self.batches.append((rows, padded_tokens, real_tokens))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)


async def until(condition: Any, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.001)
