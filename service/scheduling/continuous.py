"""Continuous (iteration-level) batching of word decoding, for the g2p kind.

One decoding thread per model instance keeps its own running batch, a decoding engine over g2p's graphs
(service.decoding.words), and steps it without returning to the event loop. A finished word leaves at
once, and its request is answered as soon as all its words are done; waiting words join the running
batch at the next step (continuous), or only once it is empty (static). Beam requests decode together in a beam
search of their own, which the thread steps in turn with the greedy batch: the two classes share
the decoding steps by cost (rows per step, words x beams for a beam search), the one served less
going next (`FairShare`), so that neither waits behind the other without bound. Admission
(bounded queue, deadlines; each class its fair share) is `service.scheduling.admission`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from service.decoding.engine import Engine
from service.decoding.engine import Sequence as Word
from service.decoding.words import WordSteps, error_of, greedy_decode, hypothesis, word, word_engine
from service.errors import Internal, ServingError, Unavailable
from service.priority import ComputeThreads
from service.scheduling.admission import Admission, BatchObserver, NullObserver, WorkItem, why_gone
from service.scheduling.config import BatchingConfig
from service.scheduling.fair_share import BEAM, GREEDY, FairShare, Work
from service.seq2seq.generation import BeamSearch, Hypothesis, StepModel, beam_search

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import BatchSpan, Tracing

__all__ = ["GenerationScheduler", "WordsRequest"]

log = logging.getLogger("qkv.scheduler")


@dataclass(eq=False)
class WordsRequest:
    """A g2p request: the words of all its elements, decoded independently."""

    sources: list[list[int]]
    max_output_length: int
    beam_size: int = 1
    with_attention: bool = False
    results: list[Hypothesis | None] = field(default_factory=list)
    remaining: int = 0


def kind_of(item: WorkItem) -> Work:
    """The class a g2p request queues and decodes in."""
    return BEAM if item.payload.beam_size > 1 else GREEDY


@dataclass(eq=False)
class _Beams:
    """A beam search running on an instance, stepped in turn with its greedy batch."""

    search: BeamSearch
    items: list[WorkItem]
    owners: list[tuple[WorkItem, int]]  # each word's request and index in it
    rows: int
    padded: int
    real: int
    span: BatchSpan | None
    seconds: float = 0.0  # compute so far, encoding included


class GenerationScheduler:
    """Continuous batching of word decoding: one decoding thread per model instance.

    Each thread keeps its own running batch (an `Engine` over g2p's graphs) and runs step after step
    without returning to the event loop: finished requests are handed back with `call_soon_threadsafe`,
    and waiting words are taken from the shared queue between steps (continuous) or only when the batch
    is empty (static). The queue and its admission counters are shared under one lock.
    """

    def __init__(
        self,
        name: str,
        config: BatchingConfig,
        models: Sequence[StepModel],
        observer: BatchObserver | None = None,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.name, self.config, self.models = name, config, list(models)
        self.compute = compute or ComputeThreads()  # the server's: its threads' priority and cores
        self.observer = observer or NullObserver()
        self.admission = Admission(name, config, len(self.models), kinds=(GREEDY, BEAM))
        self.observer.capacity(self.admission.wait_seconds, self.admission.utilization)
        self.queue: list[WorkItem] = []  # requests not yet admitted into a batch
        self._lock = threading.Condition()
        self._threads: list[threading.Thread] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._stopping = False
        self.failure = ""  # why a decoding thread stopped, once one has: every request is refused with it
        self.on_failure: Callable[[ServingError], None] | None = None  # told once, on the event loop
        self.tracer: Tracing | None = None  # set by a server that traces requests

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        first = self.compute.reserve(len(self.models))
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
            if self.failure:
                raise Unavailable(self.failure)
            self.admission.admit(item.tokens, item.deadline, kind_of(item))
            if item.trace is not None:
                item.trace.admitted(self.admission.predicted_queueing_ms(kind_of(item)))
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
        self.admission.release(item.tokens, kind_of(item))
        self.observer.queue_depth(len(self.queue))

    def _gone(self, item: WorkItem, now: float) -> bool:
        """On a decoding thread, under the lock: refuse a request that is gone; True when it was refused."""
        error = why_gone(item, now, self.observer)
        if error is None:
            return False
        self._pop(item)
        self._resolve(item, error=error)
        return True

    def _admit_into(self, batch: Engine) -> list[Word]:
        """Waiting greedy requests that fit into `batch` now (whole requests, oldest first)."""
        c = self.config
        now = time.monotonic()
        rows = len(batch.running)
        joined: list[Word] = []
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
            joined += [word(src, req.max_output_length, req.with_attention, tag=(item, j))
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

    def _waiting(self, work: Work) -> bool:
        """Under the lock: whether a request of class `work` is queued."""
        return any(kind_of(x) == work for x in self.queue)

    def _finish(self, finished: list[Hypothesis]) -> None:
        """Record finished words; answer the requests whose words are now all done."""
        done: list[tuple[WorkItem, Any, BaseException | None]] = []
        for h in finished:
            item, j = h.tag
            req: WordsRequest = item.payload
            req.results[j] = h
            req.remaining -= 1
            if req.remaining == 0:
                if item.trace is not None:
                    # A word's tokens are <s>, its output and </s>: one step produced each after <s>.
                    steps = max(len(r.tokens) - 1 for r in req.results if r is not None)
                    item.trace.finished(len(req.sources), req.beam_size, steps)
                done.append((item, req.results, None))
        self._resolve_all(done)

    def _work(self, instance: int, slot: int) -> None:
        """A decoding thread, supervised: should its loop fail outside a step, the scheduler stops (see `_died`)."""
        held: list[Any] = []  # what the loop holds: its batch, beam search and words being taken
        try:
            self._decode(instance, slot, held)
        except BaseException as e:
            self._died(instance, e, held)

    def _died(self, instance: int, error: BaseException, held: list[Any]) -> None:
        """A decoding loop failed: its requests, those queued and those to come are refused, naming the model;
        the other threads finish their batches and stop; the owner is told (the version is no longer ready)."""
        message = f"model '{self.name}' is unavailable: its decoding thread failed: {error!r}"
        log.error("%s", message, exc_info=error)
        items: dict[int, WorkItem] = {}
        for part in held:
            things = part.running if isinstance(part, Engine) else part.items if isinstance(part, _Beams) else part
            for thing in things or ():
                item = thing.tag[0] if isinstance(thing, Hypothesis | Word) else thing
                items[id(item)] = item
        with self._lock:
            first = not self.failure
            self.failure = self.failure or message
            self._stopping = True
            for item in list(self.queue):
                self._pop(item)
                items[id(item)] = item
            self._lock.notify_all()
        unavailable = Unavailable(self.failure)
        try:
            self._resolve_all([(item, None, unavailable) for item in items.values()])
            if first and self.on_failure is not None:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(self.on_failure, unavailable)
        except RuntimeError:  # the event loop is closed: no one is left to answer
            pass

    def _decode(self, instance: int, slot: int, held: list[Any]) -> None:
        self.compute.lower_this_thread(slot)
        model = self.models[instance]
        steps = WordSteps(model)
        batch = word_engine(steps, self.config.max_batch_size, self.name, self.compute)
        beams: _Beams | None = None
        share = FairShare()
        tracer = self.tracer
        company = tracer.join_counter() if tracer is not None else None
        kind = "continuous" if self.config.continuous and self.config.enabled else "static"
        while True:
            taken: list[WorkItem] = []
            new: list[Word] = []
            held[:] = (batch, beams, taken, new)  # filled in place below: `_died` finds what was taken
            with self._lock:
                while not batch.running and beams is None and not self.queue and not self._stopping:
                    self._lock.wait()
                if self._stopping and not batch.running and beams is None and not self.queue:
                    return
                beam_ready = beams is not None or self._waiting(BEAM)
                work = share.choose(bool(batch.running) or self._waiting(GREEDY), beam_ready)
                if work == GREEDY:
                    new += self._admit_into(batch)
                    if not new and not batch.running:  # the words went to another instance, or are gone
                        work = BEAM if beam_ready else None
                if work == BEAM and beams is None:
                    taken += self._next_beams()
                    if not taken:
                        work = None
                if work is None:
                    self._lock.wait(self.config.max_queue_delay_ms / 1e3)  # e.g. work taken elsewhere
                    continue
            if work == BEAM:
                if beams is None:
                    beams = self._start_beams(taken, model, instance)
                if beams is not None:
                    cost = len(beams.search)
                    beams = self._step_beams(beams)
                    share.charge(BEAM, cost)
                continue
            start = time.monotonic()
            joining = None
            if tracer is not None and new:
                joining = tracer.open_batch(self.name, [h.tag[0] for h in new], instance, kind)
            batch.join(new)
            stepping = list(batch.running)
            lengths = [len(w.prompt) for w in stepping]
            rows, real, padded = len(stepping), sum(lengths), len(stepping) * max(lengths)
            batch.step()
            failed = next((e for w in stepping if (e := error_of(w)) is not None), None)
            if failed is not None:  # the batch's requests decoded again one at a time: only the one at fault fails
                if joining is not None:
                    joining.close(rows, 0, 0)
                self._isolate(steps, stepping, failed)
                batch = word_engine(steps, self.config.max_batch_size, self.name, self.compute)
                continue
            finished = [hypothesis(w) for w in stepping if w.finished]
            seconds = time.monotonic() - start
            share.charge(GREEDY, rows)
            if company is not None:
                if joining is not None:
                    joining.close(rows, padded, real)
                company.stepped(joining, len(new), [h.tag[0].trace for h in finished])
            self._finish(finished)  # answer first, then account
            self.observer.batch(rows, padded, real, seconds)
            with self._lock:
                self.admission.measured(rows, seconds, saturated=self._full(rows))

    def _isolate(self, model: WordSteps, rows: list[Word], error: BaseException) -> None:
        """A decoding step failed: each request that had words in the batch decodes all its words again, alone,
        and is answered; one whose words still fail gets the error. The others are not failed with it."""
        items = list({id(h.tag[0]): h.tag[0] for h in rows}.values())
        log.warning("model '%s': a decoding batch of %d requests failed (%s): each decoded alone", self.name,
                    len(items), error)  # fmt: skip
        if len(items) > 1:
            self.observer.computation_failed("batch")
        for item in items:
            req: WordsRequest = item.payload
            n = req.remaining = len(req.sources)
            req.results = [None] * n
            try:
                finished = greedy_decode(model, req.sources, req.max_output_length, n, req.with_attention)
            except Exception as e:
                self.observer.computation_failed("request")
                log.error("model '%s': a request's words failed to decode alone: %s", self.name, e)
                self._resolve(item, error=Internal(f"model '{self.name}' failed on this request's words: {e}"))
                continue
            for j, h in enumerate(finished):
                h.tag = (item, j)
            self._finish(finished)

    def _full(self, rows: int) -> bool:
        """Under the lock: whether a step of `rows` ran at capacity, words waiting that could not join it.
        In a continuous batch, waiting words join at the next step while there is room, so a step of a
        partial batch says little of capacity: its words per second would predict waits many times too
        long (189 ms predicted, 3 ms queued, seen in a trace). A beam search's step of as many rows
        while work waits says as much: its rows cost about what a greedy batch's do."""
        c = self.config
        return bool(self.queue) and (rows >= c.max_batch_size or not (c.enabled and c.continuous))

    def _start_beams(self, items: list[WorkItem], model: StepModel, instance: int) -> _Beams | None:
        """A beam search over the words of all `items` (they share beam width and output limit),
        encoded; None when it failed (its requests answered with the error)."""
        reqs: list[WordsRequest] = [x.payload for x in items]
        sources = [s for req in reqs for s in req.sources]
        owners = [(item, j) for item, req in zip(items, reqs, strict=True) for j in range(len(req.sources))]
        k, limit = reqs[0].beam_size, reqs[0].max_output_length
        lengths = [len(s) for s in sources]
        rows, padded, real = len(sources) * k, len(sources) * max(lengths), sum(lengths)
        span = self.tracer.open_batch(self.name, items, instance, "beam") if self.tracer is not None else None
        start = time.monotonic()
        try:
            search = BeamSearch(model, sources, k, limit, 1, 2, any(req.with_attention for req in reqs))
        except Exception as e:
            self._beams_failed(model, items, span, rows, padded, real, e)
            return None
        return _Beams(search, items, owners, rows, padded, real, span, time.monotonic() - start)

    def _step_beams(self, beams: _Beams) -> _Beams | None:
        """One step of a running beam search: its requests whose words are all done are answered.
        The search, or None once it is done (or failed)."""
        rows = len(beams.search)
        start = time.monotonic()
        try:
            done = beams.search.step()
        except Exception as e:
            self._beams_failed(beams.search.model, beams.items, beams.span, beams.rows, beams.padded, beams.real, e)
            return None
        seconds = time.monotonic() - start
        beams.seconds += seconds
        for w, best in done:
            best.tag = beams.owners[w]
        self._finish([best for _, best in done])
        with self._lock:
            self.admission.measured(rows, seconds, saturated=self._full(rows))
        if len(beams.search):
            return beams
        if beams.span is not None:
            beams.span.close(beams.rows, beams.padded, beams.real)
        self.observer.batch(beams.rows, beams.padded, beams.real, beams.seconds)
        return None

    def _beams_failed(
        self,
        model: StepModel,
        items: list[WorkItem],
        span: BatchSpan | None,
        rows: int,
        padded: int,
        real: int,
        e: Exception,
    ) -> None:
        """A beam search failed: each of its requests not yet answered searches again alone, and only one whose
        words still fail gets the error."""
        if span is not None:
            span.close(rows, padded, real)
        pending = [x for x in items if x.payload.remaining > 0]  # those already answered keep their answer
        log.warning("model '%s': a beam search of %d requests failed (%s): each searched alone", self.name,
                    len(pending), e)  # fmt: skip
        if len(pending) > 1:
            self.observer.computation_failed("batch")
        for item in pending:
            req: WordsRequest = item.payload
            try:
                hyps = beam_search(model, req.sources, req.beam_size, req.max_output_length,
                                   with_attention=req.with_attention)  # fmt: skip
            except Exception as alone:
                self.observer.computation_failed("request")
                log.error("model '%s': a request's beam search failed alone: %s", self.name, alone)
                self._resolve(item, error=Internal(f"model '{self.name}' failed on this request's words: {alone}"))
                continue
            req.results, req.remaining = [None] * len(req.sources), len(req.sources)
            for j, h in enumerate(hyps):
                h.tag = (item, j)
            self._finish(hyps)

    async def close(self) -> None:
        """Refuse new work; let the threads finish what they hold, then stop them."""
        self._closed = True
        with self._lock:
            self._stopping = True
            self._lock.notify_all()
        for t in self._threads:
            await asyncio.get_running_loop().run_in_executor(None, t.join)
