"""What the queueing tests share: an observer that records, a wait for a condition, a wait until a blocker
holds a one-instance model computing, and a model's served statistics."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from service import protocol
from service.bench.servers import scrape
from tests.conftest import RunningServer


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


async def until(condition: Any, what: str = "the condition", timeout: float = 60.0) -> None:
    """Poll `condition` on the event loop until it holds. The deadline is generous, far beyond what a loaded
    machine needs: it only bounds a test whose condition never comes, and says which."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.001)


def model_stats(stub: Any, model: str) -> Any:
    """The server's ModelStatistics entry for `model` (`stub`: a `protocol.Stub`)."""
    return stub.ModelStatistics(protocol.ModelStatisticsRequest(name=model), timeout=5).model_stats[0]


async def until_computing(server: RunningServer, first: Any) -> None:
    """Until the blocker `first` is the one request in g2p_encoder and none is queued: it is computing."""
    series = 'qkv_inflight_requests{model="g2p_encoder",version="1"}'
    end = time.monotonic() + 60
    while True:
        metrics = scrape(server.metrics_url)
        if metrics.get(series, 0) == 1 and metrics.get('qkv_queue_depth{model="g2p_encoder",version="1"}', 0) == 0:
            return
        assert not first.done(), "the blocker was answered before it was seen computing"
        assert time.monotonic() < end, "the blocker never started computing (60 s)"
        await asyncio.sleep(0.02)
