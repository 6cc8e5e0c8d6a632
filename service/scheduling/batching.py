"""Sequence-length-aware dynamic batching for tensor models.

A batch closes on max rows, a token budget (rows x padded length) or the max queue delay;
requests of similar length go together, so padding stays small. Choosing the next batch is a
pure function (`select_batch`); `DynamicBatcher` is handed `run_batch(items, instance)` and
knows neither gRPC nor onnxruntime. Admission (bounded queue, deadlines) is `service.scheduling.admission`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from service.errors import Internal, ServingError, Unavailable
from service.priority import ComputeThreads
from service.scheduling.admission import Admission, BatchObserver, NullObserver, WorkItem, why_gone
from service.scheduling.config import BatchingConfig
from service.scheduling.loop_idle import last_idle
from service.scheduling.tuning import CostModel, Pacing, Tuning, handoff_seconds, served_seconds

OVERLAP_HANDOFFS = 3  # see `DynamicBatcher.use`

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import Tracing

__all__ = ["LONE", "DynamicBatcher", "select_batch"]

log = logging.getLogger("qkv.batching")

LONE = -1  # the instance `run_batch` is told for a batch running alone (DynamicBatcher's `lone`)


def select_batch(
    queue: Sequence[WorkItem],
    max_rows: int,
    token_budget: int,
    length_aware: bool = True,
    max_padding: float = 1.0,
) -> list[int]:
    """Indices (into `queue`, oldest first) of the next batch.

    The oldest request always goes, so nothing starves. Length-aware: the others are taken in
    order of how close their length is to its length (log ratio), while the rows, the padded
    cost (rows x longest) and the padded share of the batch stay within bounds. FIFO: taken in
    arrival order, padded to the longest, until the first that does not fit.
    """
    if not queue:
        return []
    anchor = queue[0]
    order = list(range(1, len(queue)))
    if length_aware:
        base = math.log(max(anchor.length, 1))
        order.sort(key=lambda i: (abs(math.log(max(queue[i].length, 1)) - base), i))
    chosen, rows, longest, real = [0], anchor.rows, anchor.length, anchor.tokens
    for i in order:
        item = queue[i]
        new_rows, new_longest, new_real = rows + item.rows, max(longest, item.length), real + item.tokens
        padded = new_rows * new_longest
        fits = new_rows <= max_rows and padded <= token_budget
        if length_aware and fits:
            fits = 1 - new_real / padded <= max_padding
        if not fits:
            if length_aware:
                continue
            break
        chosen.append(i)
        rows, longest, real = new_rows, new_longest, new_real
    return sorted(chosen)


def _refuse_if_gone(item: WorkItem, now: float, observer: BatchObserver) -> bool:
    """On the event loop: fail a request that is gone; True when it was refused."""
    if item.future.done():
        return True
    error = why_gone(item, now, observer)
    if error is not None:
        item.future.set_exception(error)
    return error is not None


class DynamicBatcher:
    """Per-model queue of tensor requests; one dispatcher hands batches to idle model instances.

    Idle instances are a stack: the one that finished last is used first, so at low load one
    instance (its thread, its core's caches, its onnxruntime arena) does the work while warm,
    instead of requests alternating between instances that have gone cold.
    """

    def __init__(
        self,
        name: str,
        config: BatchingConfig,
        run_batch: Callable[[list[WorkItem], int], list[Any]],
        instances: int = 1,
        observer: BatchObserver | None = None,
        lone: bool = False,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.name, self.config, self.run_batch = name, config, run_batch
        self.instances = max(1, instances)
        # A batch that runs alone on an idle server (nothing else running or queued) is handed to
        # `run_batch` as instance LONE: the model may spend every core on it.
        self.lone = lone
        self.lone_min_tokens = 0  # and holds at least this many tokens (warm-up measures where it gains)
        self.lone_inline_max_tokens = 0  # such a request this small runs on the event loop's thread
        self.observer = observer or NullObserver()
        self.admission = Admission(name, config, self.instances)
        self.observer.capacity(self.admission.wait_seconds, self.admission.utilization)
        self.queue: list[WorkItem] = []
        self._changed = asyncio.Event()
        self.compute = compute or ComputeThreads()  # the server's: its threads' priority and cores
        first = self.compute.reserve(self.instances)
        self._executors = [
            ThreadPoolExecutor(1, f"qkv-{name}-{i}", self.compute.lower_this_thread, (first + i,))
            for i in range(self.instances)
        ]
        self._idle = list(range(self.instances - 1, -1, -1))  # a stack: instance 0 on top
        self._dispatcher: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False
        self.select = select_batch  # the choice of the next batch
        self.failure = ""  # why the dispatcher stopped, once it has: every request is refused with it
        self.on_failure: Callable[[ServingError], None] | None = None  # told once, when the dispatcher dies
        self.cost: CostModel | None = None  # set by `use`: the model's measured cost, kept current
        self.pacing = Pacing(None)  # without a cost model, a partial batch waits whenever company may come
        self.tracer: Tracing | None = None  # set by a server that traces requests
        self.started_at_once = 0  # requests started on arrival, the batcher idle (`_at_once`), never queued

    def handoff_seconds(self) -> float:
        """What handing a request to an instance's thread and back costs here."""
        return handoff_seconds(self._executors[0])

    def served_seconds(self, batch: Callable[[], object]) -> float:
        """What `batch` costs as served: handed from an event loop to an instance's thread and back."""
        return served_seconds(self._executors[0], batch)

    def use(self, tuning: Tuning, cost: CostModel) -> None:
        """Batch with the tuned settings, and keep the cost model current with every batch served."""
        self.config = self.admission.config = tuning.config
        self.cost = cost
        # A tuned inline rule also asks that requests come one at a time (`Pacing.alone`): one arriving within a
        # few hand-offs of an inline computation's end had been waiting behind it.
        overlap = None if "inline_max_tokens" in tuning.given else OVERLAP_HANDOFFS * tuning.handoff_ms / 1e3
        self.pacing = Pacing(None if "max_queue_delay_ms" in tuning.given else cost, overlap)

    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"qkv-{self.name}-dispatch")
        self._dispatcher.add_done_callback(self._dispatcher_ended)

    def _dispatcher_ended(self, task: asyncio.Task[None]) -> None:
        """Supervision: a dispatcher that died fails what is queued and all that comes after, and says so."""
        error = None if task.cancelled() else task.exception()
        if error is None:
            return
        self.failure = f"model '{self.name}' is unavailable: its batch scheduler failed: {error!r}"
        log.error("%s", self.failure, exc_info=error)
        for x in self._take(list(range(len(self.queue)))):
            if not x.future.done():
                x.future.set_exception(Unavailable(self.failure))
        if self.on_failure is not None:
            self.on_failure(Unavailable(self.failure))

    async def submit(self, item: WorkItem) -> Any:
        """Queue `item` and wait for its result; raises a ServingError on refusal or failure."""
        if self.failure:
            raise Unavailable(self.failure)
        if self._closed:
            raise Unavailable(f"model '{self.name}' is shutting down")
        self.admission.admit(item.tokens, item.deadline)
        if item.trace is not None:
            item.trace.admitted(self.admission.predicted_queueing_ms())
        busy = bool(self.queue) or len(self._idle) < self.instances
        self.pacing.arrived(item.arrived, busy, last_idle())
        if self._inline(item):
            return self._run_inline(item)
        if self._at_once(item):
            self.admission.release(item.tokens)
            if not _refuse_if_gone(item, time.monotonic(), self.observer):
                self.started_at_once += 1
                self._start([item])
        else:
            self.queue.append(item)
            self.observer.queue_depth(len(self.queue))
            self._changed.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._withdraw(item)
            raise

    def _at_once(self, item: WorkItem) -> bool:
        """Whether `item`, arriving now, starts here without passing through the queue: nothing queued and every
        instance idle, where the dispatcher would choose it alone with no wait (`_ready`); handing it there
        would cost the dispatcher's wake-up, a turn of the event loop."""
        running = self._dispatcher is not None and not self._dispatcher.done()
        if not (running and not self.queue and len(self._idle) == self.instances):
            return False
        try:
            return self._choose([item]) == [0]
        except Exception:  # queued, the dispatcher's choice fails the same: its supervision answers the request
            return False

    def _inline(self, item: WorkItem) -> bool:
        """A small request on an idle server, while requests come one at a time, runs on this thread:
        handing it to an instance's thread and back costs a good share of computing it. Small is by what
        it costs where it runs: on an instance, or on every core (the lone session)."""
        idle = not self.queue and len(self._idle) == self.instances
        if not (idle and self.pacing.alone()):
            return False
        return item.tokens <= self.config.inline_max_tokens or (
            item.tokens <= self.lone_inline_max_tokens and self._alone([item])
        )

    def _alone(self, items: list[WorkItem]) -> bool:
        """Whether `items`, about to start, run alone: every instance idle, nothing left queued, requests
        coming one at a time, and enough tokens for every core to gain."""
        return (
            self.lone
            and not self.queue
            and len(self._idle) == self.instances
            and self.pacing.alone()
            and sum(x.tokens for x in items) >= self.lone_min_tokens
        )

    def _run_inline(self, item: WorkItem) -> Any:
        alone = self._alone([item])
        instance = self._idle.pop()
        self.admission.release(item.tokens)
        item.started = start = time.monotonic()
        self.observer.waited(0.0)
        span = self.tracer.open_batch(self.name, [item], instance, "inline") if self.tracer is not None else None
        try:
            (result,) = self._compute([item], LONE if alone else instance)
        finally:
            self._idle.append(instance)
            self.pacing.inlined(time.monotonic())
        if span is not None:
            span.close(item.rows, item.tokens, item.tokens, answered=True)
        if isinstance(result, BaseException):
            raise result  # a failed run says nothing about throughput
        self._measured([item], time.monotonic() - start)
        return result

    def _withdraw(self, item: WorkItem) -> None:
        """The client left: a request still queued leaves the queue now; a running one is let finish."""
        item.cancelled = True
        if item in self.queue:
            self._take([self.queue.index(item)])
            self.observer.dropped("cancelled")

    def _take(self, indices: list[int]) -> list[WorkItem]:
        taken = [self.queue[i] for i in indices]
        keep = set(indices)
        self.queue = [x for i, x in enumerate(self.queue) if i not in keep]
        for x in taken:
            self.admission.release(x.tokens)
        self.observer.queue_depth(len(self.queue))
        return taken

    def _prune(self) -> None:
        now = time.monotonic()
        gone = [i for i, x in enumerate(self.queue) if _refuse_if_gone(x, now, self.observer)]
        if gone:
            self._take(gone)

    def _ready(self) -> float:
        """0 when a batch should go now, else the seconds left of the oldest request's delay.

        A partial batch waits for company only while another instance is computing: then more
        requests are on their way. On an idle server it goes at once (no added latency).
        """
        if not self.config.enabled or len(self._idle) == self.instances:
            return 0.0
        rows = sum(x.rows for x in self.queue)
        longest = max(x.length for x in self.queue)
        if rows >= self.config.max_batch_size or rows * longest >= self.config.token_budget:
            return 0.0
        if not self.pacing.company_soon():
            return 0.0
        return max(0.0, self.queue[0].arrived + self.config.max_queue_delay_ms / 1e3 - time.monotonic())

    async def _wait(self, seconds: float | None = None) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    async def _dispatch(self) -> None:
        """Hand batches to idle instances until closed and the queue is empty."""
        while True:
            self._prune()
            if not self.queue and self._closed:
                return
            if not self.queue or not self._idle:
                await self._wait()  # a new request or a finished batch sets it
                continue
            wait = self._ready()
            if wait > 0:
                await self._wait(wait)
                continue
            self._start(self._take(self._choose(self.queue)))

    def _choose(self, queue: list[WorkItem]) -> list[int]:
        """The next batch from `queue` (indices), as the settings and `select` choose it."""
        c = self.config
        max_rows = c.max_batch_size if c.enabled else queue[0].rows
        # padding "unsafe": no padding at all, so only requests of the oldest's length go with it
        aware, padding = (True, 0.0) if c.padding == "unsafe" else (c.length_aware, c.max_padding)
        return self.select(queue, max_rows, c.token_budget, aware, padding)

    def _start(self, items: list[WorkItem]) -> None:
        """`items`, taken from the queue (or never queued), started on the idle instance on top."""
        alone = self._alone(items)
        task = asyncio.create_task(self._run(items, self._idle.pop(), alone))
        self._running.add(task)
        task.add_done_callback(self._running.discard)

    async def _run(self, items: list[WorkItem], instance: int, alone: bool = False) -> None:
        """One batch on `instance`'s thread (as LONE when `alone`); whatever goes wrong, each of its requests is
        answered."""
        try:
            await self._run_batch(items, instance, alone)
        except Exception as e:
            log.error("model '%s': batch of %d failed outside its computation", self.name, len(items), exc_info=e)
            for x in items:
                if not x.future.done():
                    x.future.set_exception(Internal(f"model '{self.name}' failed on this batch: {e}"))

    async def _run_batch(self, items: list[WorkItem], instance: int, alone: bool) -> None:
        start = time.monotonic()
        for x in items:
            x.started = start
            self.observer.waited(start - x.arrived)
        loop = asyncio.get_running_loop()
        span = self.tracer.open_batch(self.name, items, instance, "dynamic") if self.tracer is not None else None
        try:
            run_as = LONE if alone else instance
            results = await loop.run_in_executor(self._executors[instance], self._compute, items, run_as)
        finally:
            self._idle.append(instance)
            self._changed.set()
        if span is not None:
            rows = sum(x.rows for x in items)
            span.close(rows, rows * max(x.length for x in items), sum(x.tokens for x in items), answered=True)
        self._measured(items, time.monotonic() - start, failed=any(isinstance(r, BaseException) for r in results))
        for x, r in zip(items, results, strict=True):
            if x.future.done():
                continue
            if isinstance(r, BaseException):
                x.future.set_exception(r)
            else:
                x.future.set_result(r)

    def _compute(self, items: list[WorkItem], instance: int) -> list[Any]:
        """`run_batch`, a failure turned into each request's error: a runtime failure fails this batch only."""
        try:
            return self.run_batch(items, instance)
        except ServingError as e:
            return [e] * len(items)
        except Exception as e:
            log.error("model '%s': batch of %d failed: %s", self.name, len(items), e)
            return [Internal(f"model '{self.name}' failed on this batch: {e}")] * len(items)

    def _measured(self, items: list[WorkItem], seconds: float, failed: bool = False) -> None:
        """A batch's `seconds` from dispatch to results: throughput, metrics, and the cost model (which,
        like the sweep it started from, counts what a batch costs as served, hand-off included)."""
        real = sum(x.tokens for x in items)
        padded = sum(x.rows for x in items) * max(x.length for x in items)
        self.admission.measured(real, seconds, saturated=bool(self.queue))
        self.observer.batch(sum(x.rows for x in items), padded, real, seconds)
        if self.cost is not None and not failed:
            self.cost.observe(padded, seconds)

    async def close(self) -> None:
        """Refuse new work; queued and running requests still complete. The dispatcher ends once the queue
        is empty (or has died, failing it); then the batches it started are awaited."""
        self._closed = True
        self._changed.set()
        if self._dispatcher is not None:
            await asyncio.wait([self._dispatcher])
        while self._running:
            await asyncio.wait(set(self._running))
        for e in self._executors:
            e.shutdown(wait=True)
