"""A model's bounded queue: what a queued request is, the admission rules, and what becomes of a
request that is gone.

Both schedulers (`service.batching` for tensor models, `service.scheduler` for generation) queue
`WorkItem`s under the same rules: bounded requests and tokens, and a deadline-aware refusal from
the measured throughput. A request whose client left or whose deadline passed is dropped before
it is computed, and counted.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import Cancelled, DeadlineExceeded, ResourceExhausted, ServingError
from service.repository import BatchingConfig

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.tracing import RequestTrace

__all__ = ["Admission", "BatchObserver", "NullObserver", "WorkItem", "why_gone"]


@dataclass(eq=False)
class WorkItem:
    """One request in a queue: `rows` batch rows of sequence length `length`."""

    rows: int
    length: int
    payload: Any
    future: asyncio.Future[Any]
    arrived: float = field(default_factory=time.monotonic)
    deadline: float | None = None  # monotonic seconds
    started: float | None = None  # when its computation began
    cancelled: bool = False  # the client went away
    trace: RequestTrace | None = None  # set when the request is sampled for tracing (service.tracing)

    @property
    def tokens(self) -> int:
        return self.rows * self.length


class BatchObserver(Protocol):
    """What the schedulers report (the metrics module implements it)."""

    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...


class NullObserver:
    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...


class Admission:
    """Bounded queue accounting and a throughput estimate for deadline-aware admission."""

    def __init__(self, name: str, config: BatchingConfig, instances: int) -> None:
        self.name, self.config, self.instances = name, config, instances
        self.queued_requests = 0
        self.queued_tokens = 0
        self.tokens_per_second = 0.0  # all instances together, smoothed; 0 until measured

    def admit(self, tokens: int, deadline: float | None) -> None:
        """Reserve queue room for `tokens`, or raise the refusal."""
        self.check(tokens, deadline)
        self.queued_requests += 1
        self.queued_tokens += tokens

    def check(self, tokens: int, deadline: float | None) -> None:
        """Raise the refusal a request of `tokens` would get now; with 0, a refusal any request would get."""
        c = self.config
        if self.queued_requests + 1 > c.max_queue_requests or self.queued_tokens + tokens > c.max_queue_tokens:
            raise ResourceExhausted(
                f"model '{self.name}' is overloaded: {self.queued_requests} requests / {self.queued_tokens} tokens "
                f"queued (limits {c.max_queue_requests} / {c.max_queue_tokens})",
                retry_after_ms=self.predicted_wait_ms(tokens),
            )
        if self.tokens_per_second > 0:
            wait = self.queued_tokens / self.tokens_per_second
            if wait * 1e3 > c.max_queue_wait_ms:
                raise ResourceExhausted(
                    f"model '{self.name}' is overloaded: predicted queueing {wait * 1e3:.0f} ms exceeds "
                    f"{c.max_queue_wait_ms:.0f} ms",
                    retry_after_ms=self.predicted_wait_ms(tokens),
                )
        if deadline is not None and self.tokens_per_second > 0:
            wait = (self.queued_tokens + tokens) / self.tokens_per_second
            if time.monotonic() + wait > deadline:
                raise DeadlineExceeded(
                    f"model '{self.name}': the predicted wait of {wait * 1e3:.0f} ms exceeds the request's deadline",
                    retry_after_ms=self.predicted_wait_ms(tokens),
                )

    def release(self, tokens: int) -> None:
        self.queued_requests -= 1
        self.queued_tokens -= tokens

    def measured(self, tokens: int, seconds: float, saturated: bool) -> None:
        """A batch's throughput; only batches run while work was waiting say what capacity is."""
        if seconds <= 0 or not saturated:
            return
        rate = tokens / seconds * self.instances
        self.tokens_per_second = rate if not self.tokens_per_second else 0.8 * self.tokens_per_second + 0.2 * rate

    def seed(self, tokens: int, seconds: float) -> None:
        """A first estimate, from one instance's warm-up batch, until batches under load replace it."""
        if seconds > 0 and not self.tokens_per_second:
            self.tokens_per_second = tokens / seconds * self.instances

    def predicted_wait_ms(self, tokens: int) -> int:
        """The retry hint; before any throughput is measured, the longest the queue means to hold anyone."""
        if not self.tokens_per_second:
            return max(1, int(self.config.max_queue_wait_ms))
        return max(1, int((self.queued_tokens + tokens) / self.tokens_per_second * 1e3))


def why_gone(item: WorkItem, now: float, observer: BatchObserver) -> ServingError | None:
    """The error for a queued request whose client left or whose deadline passed (counted), else None."""
    if item.cancelled:
        observer.dropped("cancelled")
        return Cancelled("the client cancelled the request")
    if item.deadline is not None and now >= item.deadline:
        observer.dropped("deadline")
        return DeadlineExceeded("the request's deadline passed while it was queued")
    return None
