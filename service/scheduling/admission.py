"""A model's bounded queue: what a queued request is, the admission rules, and what becomes of a
request that is gone.

Both schedulers (dynamic batching for tensor models, continuous decoding for generation) queue
`WorkItem`s under the same rules: bounded requests and tokens, and a deadline-aware refusal from
the measured throughput. A request that could not be queued even on an empty queue is refused as
invalid (retrying cannot help), not as overload. A request whose client left or whose deadline passed
is dropped before it is computed, and counted.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from service.errors import Cancelled, DeadlineExceeded, InvalidArgument, ResourceExhausted, ServingError
from service.scheduling.config import BatchingConfig

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace

__all__ = ["DEMAND_HORIZON_S", "Admission", "BatchObserver", "Demand", "NullObserver", "Queued", "WorkItem", "why_gone"]


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
    trace: RequestTrace | None = None  # set when the request is sampled for tracing (service.observability.tracing)
    level: int = 0  # its priority level (service/scheduling/priorities.py; 1 is the highest, 0: none)
    delay_at: float | None = None  # a DELAY queue policy: from then on it waits behind every other request

    @property
    def tokens(self) -> int:
        return self.rows * self.length


class BatchObserver(Protocol):
    """What the schedulers report (the metrics module implements it)."""

    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...
    def capacity(self, wait_seconds: Callable[[], float], utilization: Callable[[], float]) -> None:
        """The model's capacity signal, read when asked (a metrics scrape): its predicted queue wait, and the
        work admitted per second over the work its batcher can do per second."""
        ...

    def computation_failed(self, scope: str) -> None:
        """A run failed in the runtime: a "batch" of several requests (retried in parts), or a "request" alone
        (answered with the error)."""
        ...


class NullObserver:
    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...
    def capacity(self, wait_seconds: Callable[[], float], utilization: Callable[[], float]) -> None: ...
    def computation_failed(self, scope: str) -> None: ...


class Queued:
    """What one class of work holds in the queue."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = self.tokens = 0


DEMAND_HORIZON_S = 20.0  # seconds of admitted work the demand estimate averages over


class Demand:
    """Work admitted per second, smoothed: admitted tokens summed with weights that halve every
    `horizon` x ln 2 seconds, over `horizon`. A steady arrival of r tokens/s reads r once a few horizons
    have passed; a load step shows within one horizon. `clock` is injected so tests decide time."""

    def __init__(self, horizon: float = DEMAND_HORIZON_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.horizon, self.clock = horizon, clock
        self.weighted = 0.0  # admitted tokens, each decayed by exp(-age / horizon)
        self.at = clock()

    def add(self, tokens: int) -> None:
        self._decay()
        self.weighted += tokens

    def per_second(self) -> float:
        self._decay()
        return self.weighted / self.horizon

    def _decay(self) -> None:
        now = self.clock()
        if now > self.at:
            self.weighted *= math.exp(-(now - self.at) / self.horizon)
            self.at = now


class Admission:
    """Bounded queue accounting and a throughput estimate for deadline-aware admission.

    Work may come in classes (`kinds`) that the scheduler serves in fair shares of its capacity,
    as the generation scheduler serves greedy and beam decoding. A request then waits for its own
    class's queue and, meanwhile, for at most as much of each other class's: its predicted wait
    counts no more than that. Each class may also fill its share of the queue bounds whatever the
    others hold, so that one class's backlog never refuses another's first request.
    """

    def __init__(
        self,
        name: str,
        config: BatchingConfig,
        instances: int,
        kinds: Sequence[str] = ("",),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name, self.config, self.instances = name, config, instances
        self.queued_requests = 0
        self.queued_tokens = 0
        self.by_kind = {kind: Queued() for kind in kinds}
        self.tokens_per_second = 0.0  # all instances together, smoothed; 0 until measured
        self.demand = Demand(clock=clock)  # tokens admitted per second

    def admit(self, tokens: int, deadline: float | None, kind: str = "") -> None:
        """Reserve queue room for `tokens` of class `kind`, or raise the refusal."""
        self.check(tokens, deadline, kind)
        self.demand.add(tokens)
        self.queued_requests += 1
        self.queued_tokens += tokens
        q = self.by_kind[kind]
        q.requests += 1
        q.tokens += tokens

    def check(self, tokens: int, deadline: float | None, kind: str | None = None) -> None:
        """Raise the refusal a request of `tokens` of class `kind` would get now; with 0 tokens and no
        class, a refusal any request would get."""
        self._never_fits(tokens)
        refusal: ServingError | None = None
        for k in [kind] if kind is not None else self.by_kind:
            error = self._refusal(tokens, deadline, k)
            if error is None:
                return
            refusal = refusal or error
        assert refusal is not None
        raise refusal

    def _never_fits(self, tokens: int) -> None:
        """Refuse a request no queue state could admit: on an empty queue, every class may hold the
        whole bounds, so one over them would be refused as overload forever."""
        c = self.config
        if tokens > c.max_queue_tokens:
            raise InvalidArgument(
                f"model '{self.name}': one request of {tokens:,} tokens can never fit max_queue_tokens "
                f'{c.max_queue_tokens:,} (config.json "batching": {{"max_queue_tokens": ...}} raises it)'
            )
        if c.max_queue_requests < 1:
            raise InvalidArgument(
                f"model '{self.name}': no request can fit max_queue_requests {c.max_queue_requests} "
                '(config.json "batching": {"max_queue_requests": ...} raises it)'
            )

    def _refusal(self, tokens: int, deadline: float | None, kind: str) -> ServingError | None:
        c = self.config
        q, share = self.by_kind[kind], len(self.by_kind)
        over_requests = (
            self.queued_requests + 1 > c.max_queue_requests and (q.requests + 1) * share > c.max_queue_requests
        )
        over_tokens = (
            self.queued_tokens + tokens > c.max_queue_tokens and (q.tokens + tokens) * share > c.max_queue_tokens
        )
        if over_requests or over_tokens:
            return ResourceExhausted(
                f"model '{self.name}' is overloaded: {self.queued_requests} requests / {self.queued_tokens} tokens "
                f"queued (limits {c.max_queue_requests} / {c.max_queue_tokens})",
                retry_after_ms=self._wait_ms(tokens, kind),
            )
        if self.tokens_per_second > 0:
            wait = self.ahead(0, kind) / self.tokens_per_second
            if wait * 1e3 > c.max_queue_wait_ms:
                return ResourceExhausted(
                    f"model '{self.name}' is overloaded: predicted queueing {wait * 1e3:.0f} ms exceeds "
                    f"{c.max_queue_wait_ms:.0f} ms",
                    retry_after_ms=self._wait_ms(tokens, kind),
                )
        if deadline is not None and self.tokens_per_second > 0:
            wait = self.ahead(tokens, kind) / self.tokens_per_second
            if time.monotonic() + wait > deadline:
                return DeadlineExceeded(
                    f"model '{self.name}': the predicted wait of {wait * 1e3:.0f} ms exceeds the request's deadline",
                    retry_after_ms=self._wait_ms(tokens, kind),
                )
        return None

    def predicted_queueing_ms(self, kind: str = "") -> float | None:
        """The wait the queue predicts for a request just admitted into class `kind` (its class's queue and its
        fair share of the others'); None until throughput is measured."""
        rate = self.tokens_per_second
        return self.ahead(0, kind) / rate * 1e3 if rate else None

    def utilization(self) -> float:
        """Work admitted per second over the work the batcher can do per second (its measured throughput):
        1 is a model kept just busy, above 1 a queue that grows. 0 until throughput is measured."""
        rate = self.tokens_per_second
        return self.demand.per_second() / rate if rate else 0.0

    def wait_seconds(self) -> float:
        """The predicted queue wait of a request arriving now, in any class: the longest; 0 until measured."""
        return max((self.predicted_queueing_ms(k) or 0.0) for k in self.by_kind) / 1e3

    def ahead(self, tokens: int, kind: str) -> int:
        """The queued tokens served before the last of `tokens` of class `kind` would be: its class's,
        and as many of each other class's (their fair share meanwhile), or all of theirs if fewer."""
        mine = self.by_kind[kind].tokens + tokens
        return mine + sum(min(q.tokens, mine) for k, q in self.by_kind.items() if k != kind)

    def release(self, tokens: int, kind: str = "") -> None:
        self.queued_requests -= 1
        self.queued_tokens -= tokens
        q = self.by_kind[kind]
        q.requests -= 1
        q.tokens -= tokens

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

    def predicted_wait_ms(self, tokens: int, kind: str | None = None) -> int:
        """The retry hint; before any throughput is measured, the longest the queue means to hold anyone.
        With no class, the shortest of any class's."""
        return min(self._wait_ms(tokens, k) for k in ([kind] if kind is not None else self.by_kind))

    def _wait_ms(self, tokens: int, kind: str) -> int:
        if not self.tokens_per_second:
            return max(1, int(self.config.max_queue_wait_ms))
        return max(1, int(self.ahead(tokens, kind) / self.tokens_per_second * 1e3))


def why_gone(item: WorkItem, now: float, observer: BatchObserver) -> ServingError | None:
    """The error for a queued request whose client left or whose deadline passed (counted), else None."""
    if item.cancelled:
        observer.dropped("cancelled")
        return Cancelled("the client cancelled the request")
    if item.deadline is not None and now >= item.deadline:
        observer.dropped("deadline")
        return DeadlineExceeded("the request's deadline passed while it was queued")
    return None
