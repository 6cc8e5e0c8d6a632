"""What the queueing tests share: an observer that records, a wait for a condition, and a model's
served statistics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from service import protocol


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


def model_stats(stub: Any, model: str) -> Any:
    """The server's ModelStatistics entry for `model` (`stub`: a `protocol.Stub`)."""
    return stub.ModelStatistics(protocol.ModelStatisticsRequest(name=model), timeout=5).model_stats[0]
