"""Sequence-length-aware batching: a bounded queue per model, batches chosen by a pure function.

Two schedulers share the admission rules (bounded requests and tokens, deadline-aware
refusal, dropping requests whose client left or whose deadline passed):

- `DynamicBatcher` for tensor models: a batch closes on max rows, a token budget (rows x
  padded length) or the max queue delay; requests of similar length go together, so padding
  stays small. It is handed `run_batch(items, instance)` and knows neither gRPC nor onnxruntime.
- `GenerationScheduler` for the g2p kind: words are decoded step by step in one
  `DecodingBatch` per instance; a finished word leaves at once, waiting words join at the next
  step (continuous batching).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from service import priority
from service.errors import Cancelled, DeadlineExceeded, Internal, ResourceExhausted, ServingError, Unavailable
from service.generation import DecodingBatch, Hypothesis, StepModel, beam_search
from service.repository import BatchingConfig

__all__ = ["BatchObserver", "DynamicBatcher", "GenerationScheduler", "WordsRequest", "WorkItem", "select_batch"]

log = logging.getLogger("qkv.batching")


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

    @property
    def tokens(self) -> int:
        return self.rows * self.length


class BatchObserver(Protocol):
    """What the schedulers report (the metrics module implements it)."""

    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...


class _NullObserver:
    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...
    def dropped(self, reason: str) -> None: ...


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


class _Admission:
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


def _why_gone(item: WorkItem, now: float, observer: BatchObserver) -> ServingError | None:
    """The error for a queued request whose client left or whose deadline passed (counted), else None."""
    if item.cancelled:
        observer.dropped("cancelled")
        return Cancelled("the client cancelled the request")
    if item.deadline is not None and now >= item.deadline:
        observer.dropped("deadline")
        return DeadlineExceeded("the request's deadline passed while it was queued")
    return None


def _refuse_if_gone(item: WorkItem, now: float, observer: BatchObserver) -> bool:
    """On the event loop: fail a request that is gone; True when it was refused."""
    if item.future.done():
        return True
    error = _why_gone(item, now, observer)
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
    ) -> None:
        self.name, self.config, self.run_batch = name, config, run_batch
        self.instances = max(1, instances)
        self.observer = observer or _NullObserver()
        self.admission = _Admission(name, config, self.instances)
        self.queue: list[WorkItem] = []
        self._changed = asyncio.Event()
        first = priority.reserve(self.instances)
        self._executors = [
            ThreadPoolExecutor(1, f"qkv-{name}-{i}", priority.lower_this_thread, (first + i,))
            for i in range(self.instances)
        ]
        self._idle = list(range(self.instances - 1, -1, -1))  # a stack: instance 0 on top
        self._dispatcher: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False

    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch())

    async def submit(self, item: WorkItem) -> Any:
        """Queue `item` and wait for its result; raises a ServingError on refusal or failure."""
        if self._closed:
            raise Unavailable(f"model '{self.name}' is shutting down")
        self.admission.admit(item.tokens, item.deadline)
        if self._inline(item):
            return self._run_inline(item)
        self.queue.append(item)
        self.observer.queue_depth(len(self.queue))
        self._changed.set()
        try:
            return await item.future
        except asyncio.CancelledError:
            self._withdraw(item)
            raise

    def _inline(self, item: WorkItem) -> bool:
        """A small request on an idle server runs on this thread: handing it to an instance's
        thread and back costs about as much as computing it."""
        c = self.config
        return item.tokens <= c.inline_max_tokens and not self.queue and len(self._idle) == self.instances

    def _run_inline(self, item: WorkItem) -> Any:
        instance = self._idle.pop()
        self.admission.release(item.tokens)
        item.started = start = time.monotonic()
        self.observer.waited(0.0)
        try:
            (result,) = self._compute([item], instance)
        finally:
            self._idle.append(instance)
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
        return max(0.0, self.queue[0].arrived + self.config.max_queue_delay_ms / 1e3 - time.monotonic())

    async def _wait(self, seconds: float | None = None) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    async def _dispatch(self) -> None:
        while True:
            self._prune()
            if not self.queue or not self._idle:
                await self._wait()  # a new request or a finished batch sets it
                continue
            wait = self._ready()
            if wait > 0:
                await self._wait(wait)
                continue
            c = self.config
            max_rows = c.max_batch_size if c.enabled else self.queue[0].rows
            items = self._take(select_batch(self.queue, max_rows, c.token_budget, c.length_aware, c.max_padding))
            task = asyncio.create_task(self._run(items, self._idle.pop()))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _run(self, items: list[WorkItem], instance: int) -> None:
        start = time.monotonic()
        for x in items:
            x.started = start
            self.observer.waited(start - x.arrived)
        loop = asyncio.get_running_loop()
        try:
            results = await loop.run_in_executor(self._executors[instance], self._compute, items, instance)
        finally:
            self._idle.append(instance)
            self._changed.set()
        self._measured(items, time.monotonic() - start)
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

    def _measured(self, items: list[WorkItem], seconds: float) -> None:
        real = sum(x.tokens for x in items)
        padded = sum(x.rows for x in items) * max(x.length for x in items)
        self.admission.measured(real, seconds, saturated=bool(self.queue))
        self.observer.batch(sum(x.rows for x in items), padded, real, seconds)

    async def close(self) -> None:
        """Refuse new work; queued and running requests still complete."""
        self._closed = True
        while self.queue or self._running:
            await asyncio.sleep(0.01)
        if self._dispatcher is not None:
            self._dispatcher.cancel()
        for e in self._executors:
            e.shutdown(wait=True)


@dataclass(eq=False)
class WordsRequest:
    """A g2p request: the words of all its elements, decoded independently."""

    sources: list[list[int]]
    max_output_length: int
    beam_size: int = 1
    with_attention: bool = False
    results: list[Hypothesis | None] = field(default_factory=list)
    remaining: int = 0


class GenerationScheduler:
    """Continuous batching of word decoding: one decoding thread per model instance.

    Each thread keeps its own `DecodingBatch` and runs step after step without returning to the
    event loop: finished requests are handed back with `call_soon_threadsafe`, and waiting words
    are taken from the shared queue between steps (continuous) or only when the batch is empty
    (static). The queue and its admission counters are shared under one lock.
    """

    def __init__(
        self,
        name: str,
        config: BatchingConfig,
        models: Sequence[StepModel],
        observer: BatchObserver | None = None,
    ) -> None:
        self.name, self.config, self.models = name, config, list(models)
        self.observer = observer or _NullObserver()
        self.admission = _Admission(name, config, len(self.models))
        self.queue: list[WorkItem] = []  # requests not yet admitted into a batch
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._stopping = False
        self._drainer: int | None = None  # the instance letting its batch run dry for waiting beams

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        first = priority.reserve(len(self.models))
        self._threads = [threading.Thread(target=self._work, args=(i, first + i), name=f"qkv-{self.name}-{i}",
                                          daemon=True) for i in range(len(self.models))]  # fmt: skip
        for t in self._threads:
            t.start()

    async def submit(self, item: WorkItem) -> list[Hypothesis]:
        if self._closed:
            raise Unavailable(f"model '{self.name}' is shutting down")
        req: WordsRequest = item.payload
        req.results = [None] * len(req.sources)
        req.remaining = len(req.sources)
        with self._lock:
            self.admission.admit(item.tokens, item.deadline)
            self.queue.append(item)
            self.observer.queue_depth(len(self.queue))
            self._lock.notify()
        try:
            return await item.future  # type: ignore[no-any-return]
        except asyncio.CancelledError:
            with self._lock:  # the client left: a request still queued leaves the queue now
                item.cancelled = True
                if item in self.queue:
                    self._pop(item)
                    self.observer.dropped("cancelled")
            raise

    # -- called on the decoding threads ------------------------------------------------------

    def _resolve(self, item: WorkItem, result: Any = None, error: BaseException | None = None) -> None:
        self._resolve_all([(item, result, error)])

    def _resolve_all(self, outcomes: list[tuple[WorkItem, Any, BaseException | None]]) -> None:
        """Hand results to the event loop: one wake-up for all of them (each costs a write to its
        self-pipe, a system call made holding the GIL the loop needs)."""

        def settle() -> None:
            for item, result, error in outcomes:
                if item.future.done():
                    continue
                if error is not None:
                    item.future.set_exception(error)
                else:
                    item.future.set_result(result)

        if outcomes:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(settle)

    def _pop(self, item: WorkItem) -> None:
        self.queue.remove(item)
        self.admission.release(item.tokens)
        self.observer.queue_depth(len(self.queue))

    def _gone(self, item: WorkItem, now: float) -> bool:
        """On a decoding thread, under the lock: refuse a request that is gone; True when it was refused."""
        error = _why_gone(item, now, self.observer)
        if error is None:
            return False
        self._pop(item)
        self._resolve(item, error=error)
        return True

    def _admit_into(self, batch: DecodingBatch) -> list[Hypothesis]:
        """Waiting greedy requests that fit into `batch` now (whole requests, oldest first)."""
        c = self.config
        now = time.monotonic()
        rows = len(batch)
        joined: list[Hypothesis] = []
        if rows and not (c.continuous and c.enabled):  # static batching, or none: no one joins a running batch
            return joined
        for item in [x for x in self.queue if x.payload.beam_size == 1]:
            self._gone(item, now)
        greedy = [x for x in self.queue if x.payload.beam_size == 1]
        if rows and greedy:
            # Joining costs an encoder run: gather a few words first, unless the oldest has waited enough.
            waiting = sum(len(x.payload.sources) for x in greedy)
            patience = greedy[0].arrived + c.max_queue_delay_ms / 1e3 - now
            if waiting < min(c.min_join_rows, c.max_batch_size - rows) and patience > 0:
                return joined
        for item in greedy:
            req: WordsRequest = item.payload
            n = len(req.sources)
            if rows and rows + n > c.max_batch_size:
                break
            self._pop(item)
            item.started = now
            self.observer.waited(now - item.arrived)
            joined += [Hypothesis(src, req.max_output_length, tag=(item, j), with_attention=req.with_attention)
                       for j, src in enumerate(req.sources)]  # fmt: skip
            rows += n
            if not c.enabled:
                break
        return joined

    def _next_beams(self) -> list[WorkItem]:
        """The oldest waiting beam request and those that can decode beside it: the same beam width
        and output limit, within max_batch_size rows (words x beams); alone with batching off."""
        c = self.config
        now = time.monotonic()
        waiting = [x for x in self.queue if x.payload.beam_size > 1 and not self._gone(x, now)]
        taken: list[WorkItem] = []
        rows = 0
        for item in waiting:
            req: WordsRequest = item.payload
            first: WordsRequest = (taken[0] if taken else item).payload
            n = len(req.sources) * req.beam_size
            if taken and ((req.beam_size, req.max_output_length) != (first.beam_size, first.max_output_length)
                          or rows + n > c.max_batch_size):  # fmt: skip
                continue
            self._pop(item)
            item.started = now
            self.observer.waited(now - item.arrived)
            taken.append(item)
            rows += n
            if not c.enabled:
                break
        return taken

    def _drains_for_beams(self, instance: int) -> bool:
        """Whether this instance should take no one into its batch, so that it runs dry for the waiting
        beam requests. They start only on an empty batch, and under continuous load a batch may never
        empty. Once the oldest has waited max_queue_delay_ms, one instance stops taking joins."""
        oldest = next((x for x in self.queue if x.payload.beam_size > 1), None)
        if oldest is None:
            if self._drainer == instance:
                self._drainer = None
            return False
        if self._drainer is None and time.monotonic() - oldest.arrived >= self.config.max_queue_delay_ms / 1e3:
            self._drainer = instance
        return self._drainer == instance

    def _finish(self, finished: list[Hypothesis]) -> None:
        """Record finished words; answer the requests whose words are now all done."""
        done: list[tuple[WorkItem, Any, BaseException | None]] = []
        for h in finished:
            item, j = h.tag  # type: ignore[misc]
            req: WordsRequest = item.payload
            req.results[j] = h
            req.remaining -= 1
            if req.remaining == 0:
                done.append((item, req.results, None))
        self._resolve_all(done)

    def _work(self, instance: int, slot: int) -> None:
        priority.lower_this_thread(slot)
        model = self.models[instance]
        batch = DecodingBatch(model)
        while True:
            with self._lock:
                while not len(batch) and not self.queue and not self._stopping:
                    self._lock.wait()
                if self._stopping and not len(batch) and not self.queue:
                    return
                beams = [] if len(batch) else self._next_beams()
                new = [] if beams or self._drains_for_beams(instance) else self._admit_into(batch)
                if not beams and not new and not len(batch):
                    self._lock.wait(self.config.max_queue_delay_ms / 1e3)  # e.g. only beams, taken elsewhere
                    continue
            if beams:
                self._run_beams(beams, model)
                continue
            start = time.monotonic()
            try:
                batch.add(new)
                rows, real = len(batch), int(batch.memory_mask.sum())
                padded = batch.memory_mask.size
                finished = batch.step()
            except Exception as e:  # fail every request in this batch, keep serving
                log.error("model '%s': decoding batch failed: %s", self.name, e)
                failed = {id(h.tag[0]): h.tag[0] for h in [*batch.rows, *new]}  # type: ignore[index]
                for item in failed.values():
                    self._resolve(item, error=Internal(f"model '{self.name}' failed on this batch: {e}"))
                batch = DecodingBatch(model)
                continue
            seconds = time.monotonic() - start
            self._finish(finished)  # answer first, then account
            self.observer.batch(rows, padded, real, seconds)
            with self._lock:
                self.admission.measured(rows, seconds, saturated=bool(self.queue))

    def _run_beams(self, items: list[WorkItem], model: StepModel) -> None:
        """One beam search over the words of all `items`; each request is answered as soon as its
        own words are done."""
        reqs: list[WordsRequest] = [x.payload for x in items]
        sources = [s for req in reqs for s in req.sources]
        owners = [(item, j) for item, req in zip(items, reqs, strict=True) for j in range(len(req.sources))]

        def on_word(index: int, best: Hypothesis) -> None:
            best.tag = owners[index]
            self._finish([best])

        k, limit = reqs[0].beam_size, reqs[0].max_output_length
        start = time.monotonic()
        try:
            beam_search(model, sources, k, limit, 1, 2, any(req.with_attention for req in reqs), on_word)
        except Exception as e:
            log.error("model '%s': beam search failed: %s", self.name, e)
            error = Internal(f"model '{self.name}' failed on this request: {e}")
            self._resolve_all([(x, None, error) for x in items])  # those already answered keep their answer
            return
        lengths = [len(s) for s in sources]
        self.observer.batch(len(sources) * k, len(sources) * max(lengths), sum(lengths), time.monotonic() - start)

    async def close(self) -> None:
        """Refuse new work; let the threads finish what they hold, then stop them."""
        self._closed = True
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for t in self._threads:
            await asyncio.get_running_loop().run_in_executor(None, t.join)
