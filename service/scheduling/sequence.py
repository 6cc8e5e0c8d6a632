# Over 500 lines: Triton's sequence batcher whole: its invariants (ids, state, reaper) span all of it.
"""Sequence batching for stateful models, after Triton's sequence batcher.

A client sends the requests of a sequence under one correlation id (an integer or a string), the first
marked `start`, the last `end`. The batcher keeps each live sequence, runs its requests strictly in order
(one in flight per sequence), and batches the requests of different sequences together. For each batch
row it fills the model's control inputs (START, END, READY, CORRID, in the datatypes config.json gives)
and its implicit state inputs, from the state outputs of the sequence's previous request (on a sequence's
first request: zeros, or a file's values), and stores the state outputs back after the run.

Strategies: `oldest` batches the oldest waiting request of up to max_batch_size sequences, on any idle
instance (the state lives here, not in the instance). `direct` binds each sequence to a batch slot of one
instance for its life: row k of that instance's batches is always the same sequence, and a slot with no
request runs as a row with READY false. Either way a batch holds only rows whose inputs and states have
the shapes of its oldest row's, as Triton batches them: a state may change shape from one request to the
next (a key/value cache grows a position a step), and rows of other shapes wait for the next batch.

Bounded: live sequences (max_sequences; for direct, also the slots), their state bytes (max_state_bytes)
and queued requests; with --isolate-tokens, a sequence is its caller's (service/callers.py): another
caller's request finds no sequence of that id (NOT_FOUND, or a start of its own), and each caller may hold
its share (--token-share) of max_sequences and max_state_bytes. A new sequence beyond them is refused
RESOURCE_EXHAUSTED (retryable). A sequence idle for max_sequence_idle_microseconds is freed at that moment
by a reaper task (and, at the latest, when the next request comes). The clock and the reaper's sleep are
injected (tests drive them, never sleep). Two supervised tasks: the dispatcher and the reaper; should either
fail, the model refuses every request with UNAVAILABLE and says why. Like `DynamicBatcher`, it knows neither
gRPC nor onnxruntime: it is handed `run_batch(steps, instance)`, and reports to a `SequenceObserver`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from service.callers import Caller, share_of
from service.datatypes import NUMPY_DTYPES, decode_bytes
from service.errors import Internal, InvalidArgument, NotFound, ResourceExhausted, ServingError, Unavailable, quote
from service.priority import ComputeThreads
from service.scheduling.sequence_config import Control, SequenceConfig, StateSpec

__all__ = [
    "MAX_ID_CHARS",
    "CorrelationId",
    "SequenceBatcher",
    "SequenceObserver",
    "SequenceStep",
    "initial_state",
    "select_oldest",
]

log = logging.getLogger("qkv.sequence")

CorrelationId = int | str
SequenceKey = CorrelationId | tuple[str, CorrelationId]  # a caller's sequences are keyed by (its name, id)
MAX_ID_CHARS = 256  # a string correlation id, at most (it is kept while its sequence lives)
MAX_QUEUED = 4096  # requests waiting in all sequences together, at most


class SequenceObserver(Protocol):
    """What the batcher reports as sequences come and go (the metrics, service/observability/metrics.py)."""

    def sequences(self, live: int, state_bytes: int) -> None: ...
    def sequences_expired(self, count: int) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...


class _NoObserver:
    def sequences(self, live: int, state_bytes: int) -> None: ...
    def sequences_expired(self, count: int) -> None: ...
    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None: ...


@dataclass(eq=False)
class SequenceStep:
    """One request of a sequence: one batch row.

    `inputs` are the client's tensors (batch axis of 1); the batcher adds the controls and states to
    `feeds`, which is what `run_batch` reads. A filler row (direct strategy, a slot with no request) has
    `ready` False, no future, and inputs of zeros."""

    sequence_id: CorrelationId
    start: bool
    end: bool
    inputs: dict[str, np.ndarray]
    future: asyncio.Future[Any] | None
    outputs: tuple[str, ...] = ()  # requested by the client: a state output is answered only when named
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    ready: bool = True
    arrived: float = 0.0  # the batcher's clock
    order: int = 0  # arrival order, across sequences
    caller: Caller | None = None  # whose sequence it is (--isolate-tokens; None: everyone's)


@dataclass(eq=False)
class _Sequence:
    id: CorrelationId
    key: SequenceKey  # in `live`: the id, or (the caller's name, the id)
    owner: str  # the caller's name ("" without isolation)
    slot: tuple[int, int] | None  # direct: (instance, row)
    state: dict[str, np.ndarray]  # state input name -> its value for the next request (1, *dims)
    last_active: float  # set only by `SequenceBatcher._touch`, which keeps `live` in this order
    queue: deque[SequenceStep] = field(default_factory=deque)
    running: bool = False
    ending: bool = False  # an END request is queued (and no start after it)
    requests: int = 0  # admitted since its latest start, that one included

    @property
    def state_bytes(self) -> int:
        return sum(_nbytes(a) for a in self.state.values())


def _nbytes(a: np.ndarray) -> int:
    if a.dtype == np.object_:
        return sum(len(x) if isinstance(x, bytes | str) else 8 for x in a.reshape(-1)) + 8 * a.size
    return int(a.nbytes)


def initial_state(spec: StateSpec, model_dir: Path | None = None) -> np.ndarray:
    """A state input's value on a sequence's first request, one row: (1, *dims). Zeros (a variable
    dimension as 1), or initial_state/<data_file> in `model_dir`: raw row-major values (for BYTES, each
    element a 4-byte little-endian length, then its bytes). Raises ValueError saying what is wrong."""
    init = spec.initial
    dims = spec.initial_dims
    dtype = NUMPY_DTYPES[spec.datatype]
    count = int(np.prod(dims, dtype=np.int64))
    if init is None or init.data_file is None:
        if spec.datatype == "BYTES":
            return np.full((1, *dims), b"", dtype=np.object_)
        return np.zeros((1, *dims), dtype=dtype)
    if model_dir is None:
        raise ValueError(f"state {spec.input_name!r}: initial_state.data_file needs the model's directory")
    path = model_dir / "initial_state" / init.data_file
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise ValueError(f"state {spec.input_name!r}: cannot read initial_state data_file {path}: {e}") from None
    if spec.datatype == "BYTES":
        try:
            values = decode_bytes(raw, count, spec.input_name)
        except ServingError as e:
            raise ValueError(f"state {spec.input_name!r}: initial_state data_file {path}: {e}") from None
        return values.reshape(1, *dims)
    want = count * np.dtype(dtype).itemsize
    if len(raw) != want:
        raise ValueError(
            f"state {spec.input_name!r}: initial_state data_file {path} holds {len(raw)} bytes, "
            f"dims {list(dims)} of {spec.datatype} need {want}"
        )
    return np.frombuffer(raw, dtype=dtype).reshape(1, *dims).copy()


def select_oldest(heads: list[SequenceStep], max_rows: int) -> list[SequenceStep]:
    """The next batch of the oldest strategy: the oldest waiting request of up to `max_rows` sequences
    (`heads`: one per sequence, its next request), in arrival order."""
    return sorted(heads, key=lambda s: s.order)[:max_rows]


def _flag(control: Control, on: bool) -> np.ndarray:
    return np.array([[control.false_true[1] if on else control.false_true[0]]], dtype=NUMPY_DTYPES[control.datatype])


_INT_RANGES = {
    "UINT64": (0, 1 << 64),
    "INT64": (-(1 << 63), 1 << 63),
    "UINT32": (0, 1 << 32),
    "INT32": (-(1 << 31), 1 << 31),
}


class SequenceBatcher:
    """Live sequences of one model, their requests in order, batched across sequences.

    `run_batch(steps, instance)` runs on the instance's thread and returns, per step, its outputs (a dict
    of arrays with a batch axis of 1, state outputs included) or an exception for that step alone.
    `initial`: each state input's first value (`initial_state`); zeros of its dims when left out.
    `clock` and `sleep` go together: the reaper sleeps `sleep(seconds)` until the `clock` says a
    sequence's idle time is up."""

    def __init__(
        self,
        name: str,
        config: SequenceConfig,
        run_batch: Callable[[list[SequenceStep], int], list[Any]],
        max_batch_size: int,
        instances: int = 1,
        clock: Callable[[], float] = time.monotonic,
        initial: dict[str, np.ndarray] | None = None,
        max_queued: int = MAX_QUEUED,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        observer: SequenceObserver | None = None,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.name, self.config, self.run_batch, self.clock, self.sleep = name, config, run_batch, clock, sleep
        self.observer: SequenceObserver = observer or _NoObserver()
        self.max_rows = max(1, max_batch_size)
        self.instances = max(1, instances)
        self.max_queued = max_queued
        self.initial = {s.input_name: (initial or {}).get(s.input_name) for s in config.states}
        for s in config.states:
            if self.initial[s.input_name] is None:
                self.initial[s.input_name] = initial_state(s)
        # Least recently active first: every touch moves a sequence to the end, and the idle time is the same
        # for all, so the next to expire is the first idle one (expiry never scans every live sequence).
        self.live: OrderedDict[SequenceKey, _Sequence] = OrderedDict()
        self.queued = 0
        self.state_bytes = 0  # of every live sequence's state
        self.owned: dict[str, list[int]] = {}  # a caller's name -> [its live sequences, their state bytes]
        self.expired = 0  # sequences freed for idling (a count for tests and metrics)
        self._free_slots = [(i, r) for r in range(self.max_rows - 1, -1, -1) for i in range(self.instances - 1, -1, -1)]
        self._idle = list(range(self.instances - 1, -1, -1))
        self._order = itertools.count()
        self._changed = asyncio.Event()
        self._went_idle = asyncio.Event()  # a sequence finished a request: the reaper may have one to time
        self._dispatcher: asyncio.Task[None] | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self._closed = False
        self.failure = ""  # why the dispatcher or the reaper stopped, once one has: every request is refused with it
        self.on_failure: Callable[[ServingError], None] | None = None  # told once, when a task dies
        self.compute = compute or ComputeThreads()  # the server's: its threads' priority and cores
        first = self.compute.reserve(self.instances)
        self._executors = [
            ThreadPoolExecutor(1, f"qkv-{name}-seq{i}", self.compute.lower_this_thread, (first + i,))
            for i in range(self.instances)
        ]

    # --- admission ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._dispatcher = asyncio.create_task(self._dispatch(), name=f"qkv-{self.name}-sequence-dispatch")
        self._reaper = asyncio.create_task(self._reap(), name=f"qkv-{self.name}-sequence-reaper")
        for task in (self._dispatcher, self._reaper):
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """Supervision: a dispatcher, reaper or batch that died fails what is queued and all that comes after,
        and says so (the registry, told by `on_failure`, takes the version out)."""
        error = None if task.cancelled() else task.exception()
        if error is None or self.failure:
            return
        self.failure = f"model '{self.name}' is unavailable: its sequence batcher's {task.get_name()} failed: {error!r}"
        log.error("%s", self.failure, exc_info=error)
        self._fail_queued(Unavailable(self.failure))
        if self.on_failure is not None:
            self.on_failure(Unavailable(self.failure))

    def _fail_queued(self, error: ServingError) -> None:
        for seq in list(self.live.values()):
            while seq.queue:
                step = seq.queue.popleft()
                self.queued -= 1
                if step.future is not None and not step.future.done():
                    step.future.set_exception(error)

    async def submit(self, step: SequenceStep) -> dict[str, np.ndarray]:
        """Queue one request of a sequence and wait for its outputs; raises a ServingError on refusal or failure.

        A client that goes away does not withdraw its request: the sequence's later requests depend on
        the state it leaves."""
        assert step.future is not None
        self._admit(step)
        if self._idle:  # with every instance computing, only a batch's end can start the next one
            self._changed.set()
        # Shielded: the client's leaving does not cancel the step (shield reads the step's error then).
        return await asyncio.shield(step.future)

    def _admit(self, step: SequenceStep) -> None:
        if self.failure:
            raise Unavailable(self.failure)
        if self._closed:
            raise Unavailable(f"model '{self.name}' is shutting down")
        sid = self._checked_id(step.sequence_id)
        step.sequence_id = sid
        self._check_rows(step)
        self._corrid_value(sid)  # a correlation id the CORRID control cannot hold is refused now
        now = self.clock()
        self.expire(now)
        if self.queued >= self.max_queued:
            raise ResourceExhausted(
                f"model '{self.name}': {self.queued} sequence requests queued, the limit",
                retry_after_ms=max(1, self.config.max_queue_delay_us // 1000),
            )
        key: SequenceKey = sid if step.caller is None else (step.caller.name, sid)
        seq = self.live.get(key)
        if seq is None:
            if not step.start:
                # A caller's: NOT_FOUND, whether another caller has a sequence of this id or none has.
                error = InvalidArgument if step.caller is None else NotFound
                raise error(
                    f"model '{self.name}': sequence {self._shown(sid)} is not live (never started, ended, or idle "
                    f"longer than max_sequence_idle_microseconds {self.config.max_sequence_idle_us} and freed): "
                    "its first request must set sequence_start"
                )
            seq = self._open(sid, key, step.caller, now)
        elif seq.ending and not step.start:
            raise InvalidArgument(
                f"model '{self.name}': sequence {self._shown(sid)} has ended (its sequence_end request is already "
                "queued): a new sequence must set sequence_start"
            )
        elif not step.start and self.config.max_sequence_requests and seq.requests >= self.config.max_sequence_requests:
            # Its state has grown as far as the model takes it (a key/value cache past the graph's positions):
            # the run would fail inside the model. The sequence ends here.
            seq.ending = True
            if not seq.queue and not seq.running:
                self._free(seq)
            raise InvalidArgument(
                f"model '{self.name}': sequence {self._shown(sid)} has had {seq.requests} requests, "
                f"sequence_batching.max_sequence_requests {self.config.max_sequence_requests}: the sequence is ended"
            )
        elif step.start:
            log.warning(
                "model '%s': sequence %s started again before it ended; its queued requests run first, then it "
                "restarts from its initial state",
                self.name,
                self._shown(sid),
            )
        if step.end:
            seq.ending = True
        elif step.start:
            seq.ending = False
        seq.requests = 1 if step.start else seq.requests + 1
        step.arrived, step.order = now, next(self._order)
        seq.queue.append(step)
        self._touch(seq, now)
        self.queued += 1

    def _checked_id(self, sid: Any) -> CorrelationId:
        if isinstance(sid, bool) or not isinstance(sid, int | str):
            raise InvalidArgument(
                f"model '{self.name}' serves sequences: parameter 'sequence_id' must be an integer or a string"
            )
        if sid == 0 or sid == "":
            raise InvalidArgument(
                f"model '{self.name}' serves sequences: every request needs a non-zero, non-empty 'sequence_id' "
                "(the correlation id shared by the requests of one sequence)"
            )
        if isinstance(sid, str) and len(sid) > MAX_ID_CHARS:
            raise InvalidArgument(f"sequence_id {quote(sid)} is too long: the limit is {MAX_ID_CHARS} characters")
        if isinstance(sid, int) and not -(1 << 63) <= sid < 1 << 64:
            raise InvalidArgument(f"sequence_id {sid} does not fit 64 bits")
        return sid

    def _check_rows(self, step: SequenceStep) -> None:
        for name, a in step.inputs.items():
            if a.ndim == 0 or a.shape[0] != 1:
                raise InvalidArgument(
                    f"model '{self.name}': input '{name}' has batch size {a.shape[0] if a.ndim else 'none'} "
                    f"(shape {list(a.shape)}); a request of a sequence is one row: batch size 1"
                )

    def _shown(self, sid: CorrelationId) -> str:
        return quote(sid) if isinstance(sid, str) else str(sid)

    def _open(self, sid: CorrelationId, key: SequenceKey, caller: Caller | None, now: float) -> _Sequence:
        """A new live sequence, within the bounds (and the caller's share of them), or RESOURCE_EXHAUSTED (retry
        when one ends or idles out)."""
        c = self.config
        initial_bytes = sum(_nbytes(a) for a in self.initial.values() if a is not None)
        full = None
        if len(self.live) >= c.max_sequences:
            full = f"{len(self.live)} live sequences, the limit (sequence_batching.max_sequences {c.max_sequences})"
        elif c.strategy == "direct" and not self._free_slots:
            full = f"all {self.instances * self.max_rows} batch slots held by live sequences (direct strategy)"
        elif self.state_bytes + initial_bytes > c.max_state_bytes:
            full = (
                f"{self.state_bytes:,} bytes of sequence state held, a new sequence needs {initial_bytes:,} more "
                f"(sequence_batching.max_state_bytes {c.max_state_bytes:,})"
            )
        elif caller is not None:
            sequences, held = self.owned.get(caller.name, (0, 0))
            if sequences >= share_of(c.max_sequences, caller):
                full = (
                    f"{sequences} live sequences, this caller's share of sequence_batching.max_sequences "
                    f"{c.max_sequences} (--token-share)"
                )
            elif held + initial_bytes > share_of(c.max_state_bytes, caller):
                full = (
                    f"{held:,} bytes of sequence state held by this caller, a new sequence needs {initial_bytes:,} "
                    f"more, over this caller's share of sequence_batching.max_state_bytes {c.max_state_bytes:,} "
                    "(--token-share)"
                )
        if full is not None:
            raise ResourceExhausted(
                f"model '{self.name}': cannot start sequence {self._shown(sid)}: {full}; retry when a sequence "
                "ends or idles out",
                retry_after_ms=self._next_expiry_ms(now),
            )
        slot = self._free_slots.pop() if c.strategy == "direct" else None
        seq = _Sequence(sid, key, caller.name if caller is not None else "", slot, {}, now)
        self.live[key] = seq
        self._owned(seq.owner, 1, 0)
        self._set_state(seq, self._initial_copy())
        self._observe()
        return seq

    def _set_state(self, seq: _Sequence, state: dict[str, np.ndarray]) -> None:
        """The sequence's state replaced, the bytes held counted (its caller's too)."""
        added = sum(_nbytes(a) for a in state.values()) - seq.state_bytes
        seq.state = state
        self.state_bytes += added
        self._owned(seq.owner, 0, added)

    def _owned(self, owner: str, sequences: int, state_bytes: int) -> None:
        """A caller's live sequences and state bytes counted (a caller holding none is forgotten)."""
        if not owner or (not sequences and not state_bytes):
            return
        held = self.owned.setdefault(owner, [0, 0])
        held[0] += sequences
        held[1] += state_bytes
        if held == [0, 0]:
            del self.owned[owner]

    def _touch(self, seq: _Sequence, now: float) -> None:
        """The sequence was active at `now`: its idle time starts again, and it moves to the end of `live`."""
        seq.last_active = now
        if self.live.get(seq.key) is seq:
            self.live.move_to_end(seq.key)

    def _observe(self) -> None:
        self.observer.sequences(len(self.live), self.state_bytes)

    def _initial_copy(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.initial.items() if v is not None}

    def _next_expiry_ms(self, now: float) -> int:
        due = self._next_due()
        idle = self.config.max_sequence_idle_us / 1e6
        return max(1, int((idle if due is None else due - now) * 1e3))

    def _next_due(self) -> float | None:
        """When the next idle sequence (nothing queued or running) is to be freed, by the clock; None when
        no sequence is idle. Busy sequences come before it in `live` only while they are busy."""
        idle = self.config.max_sequence_idle_us / 1e6
        return next((s.last_active + idle for s in self.live.values() if not s.queue and not s.running), None)

    def expire(self, now: float | None = None) -> int:
        """Free the sequences idle (nothing queued or running) for max_sequence_idle_microseconds or more;
        how many were freed."""
        now = self.clock() if now is None else now
        idle = self.config.max_sequence_idle_us / 1e6
        gone = []
        for s in self.live.values():
            if now < s.last_active + idle:
                break  # the rest were active later still
            if not s.queue and not s.running:
                gone.append(s)
        for s in gone:
            # debug: thousands may expire together (the count is a metric, qkv_sequences_expired_total)
            log.debug("model '%s': sequence %s idle for %.3f s: freed", self.name, self._shown(s.id), idle)
            self._free(s)
        if gone:
            self.expired += len(gone)
            self.observer.sequences_expired(len(gone))
        return len(gone)

    async def _reap(self) -> None:
        """Active expiry: each idle sequence is freed when its idle time is up, requests or none."""
        while True:
            self._went_idle.clear()
            due = self._next_due()
            if due is None:
                await self._went_idle.wait()
                continue
            await self.sleep(max(0.0, due - self.clock()))
            self.expire()

    def _free(self, seq: _Sequence) -> None:
        if self.live.get(seq.key) is seq:
            del self.live[seq.key]
            self._owned(seq.owner, -1, 0)
        self._set_state(seq, {})
        if seq.slot is not None:
            self._free_slots.append(seq.slot)
            self._free_slots.sort(key=lambda s: (-s[1], -s[0]))  # the lowest row is reused first
            seq.slot = None
        self._observe()

    # --- batches ---------------------------------------------------------------------------------

    def _heads(self, instance: int | None = None) -> list[tuple[_Sequence, SequenceStep]]:
        return [
            (s, s.queue[0])
            for s in self.live.values()
            if s.queue and not s.running and (instance is None or (s.slot is not None and s.slot[0] == instance))
        ]

    def _next_batch(self) -> tuple[int, list[tuple[_Sequence | None, SequenceStep]]] | None:
        """The next batch and the idle instance to run it, or None when nothing can run now."""
        if not self._idle:
            return None
        if self.config.strategy == "direct":
            for instance in reversed(self._idle):  # the top of the idle stack first
                heads = self._heads(instance)
                if heads:
                    self._idle.remove(instance)
                    return instance, self._slot_rows(heads)
            return None
        heads = self._heads()
        if not heads:
            return None
        shapes = self._shapes(*min(heads, key=lambda x: x[1].order))
        alike = [h for s, h in heads if self._shapes(s, h) == shapes]
        chosen = {id(step) for step in select_oldest(alike, self.max_rows)}
        rows: list[tuple[_Sequence | None, SequenceStep]] = sorted(
            ((s, h) for s, h in heads if id(h) in chosen), key=lambda x: x[1].order
        )
        return self._idle.pop(), rows

    def _slot_rows(self, heads: list[tuple[_Sequence, SequenceStep]]) -> list[tuple[_Sequence | None, SequenceStep]]:
        """Direct: rows 0..the highest ready slot whose request has the shapes of the oldest; any other slot
        is a filler row, READY false, of zeros in those shapes (its own request, if any, waits)."""
        seq, sample = min(heads, key=lambda x: x[1].order)
        shapes = self._shapes(seq, sample)
        by_row = {s.slot[1]: (s, h) for s, h in heads if s.slot is not None and self._shapes(s, h) == shapes}
        zeros = {k: np.zeros_like(v) for k, v in (sample.inputs | self._row_state(seq, sample)).items()}
        rows: list[tuple[_Sequence | None, SequenceStep]] = []
        for r in range(max(by_row) + 1):
            if r in by_row:
                rows.append(by_row[r])
            else:
                rows.append((None, SequenceStep(0, False, False, dict(zeros), None, ready=False)))
        return rows

    def _row_state(self, seq: _Sequence, step: SequenceStep) -> dict[str, np.ndarray]:
        """The state the step will run with: the initial one on a start."""
        state = self.initial if step.start else seq.state
        return {k: v for k, v in state.items() if v is not None}

    def _shapes(self, seq: _Sequence, step: SequenceStep) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """What rows of one batch share: the shape of every input and state (rows are stacked on axis 0)."""
        return tuple(sorted((k, v.shape) for k, v in (step.inputs | self._row_state(seq, step)).items()))

    def _wait_for_company(self) -> float:
        """Seconds a partial batch (oldest) waits for more sequences: only while an instance computes
        (then requests are on their way), at most max_queue_delay_microseconds after the oldest arrived."""
        c = self.config
        if c.strategy != "oldest" or not c.max_queue_delay_us or len(self._idle) == self.instances:
            return 0.0
        heads = self._heads()
        if not heads or len(heads) >= self.max_rows:
            return 0.0
        oldest = min(h.arrived for _, h in heads)
        return max(0.0, oldest + c.max_queue_delay_us / 1e6 - self.clock())

    def _feeds(self, seq: _Sequence | None, step: SequenceStep) -> None:
        """The row's model inputs: the client's, the controls, the state (reset on a start)."""
        if seq is not None and step.start:
            self._set_state(seq, self._initial_copy())
        feeds = dict(step.inputs)
        for c in self.config.controls:
            if c.kind == "CORRID":
                feeds[c.input_name] = self._corrid(c, step.sequence_id if step.ready else 0)
            else:
                on = {"START": step.start, "END": step.end, "READY": step.ready}[c.kind]
                feeds[c.input_name] = _flag(c, on)
        for s in self.config.states:  # a filler row brings zeros of its batch's state shapes
            value = seq.state[s.input_name] if seq is not None else step.inputs.get(s.input_name)
            assert value is not None
            feeds[s.input_name] = value
        step.feeds = feeds

    def _corrid_value(self, sid: CorrelationId) -> CorrelationId:
        """The correlation id as the CORRID control holds it, or INVALID_ARGUMENT when it cannot."""
        control = self.config.control("CORRID")
        if control is None or control.datatype == "BYTES":
            return str(sid)
        value = sid
        if isinstance(sid, str):
            if not sid.lstrip("-").isdigit() or len(sid) > 20:
                raise InvalidArgument(
                    f"model '{self.name}': sequence_id {quote(sid)} is a string, and the model's correlation id "
                    f"input '{control.input_name}' is {control.datatype}: send an integer"
                )
            value = int(sid)
        low, high = _INT_RANGES[control.datatype]
        assert isinstance(value, int)
        if not low <= value < high:
            raise InvalidArgument(
                f"model '{self.name}': sequence_id {value} does not fit the model's correlation id input "
                f"'{control.input_name}' ({control.datatype})"
            )
        return value

    def _corrid(self, control: Control, sid: CorrelationId) -> np.ndarray:
        value = self._corrid_value(sid) if sid != 0 else (b"" if control.datatype == "BYTES" else 0)
        if control.datatype == "BYTES":
            return np.array([[value if isinstance(value, bytes) else str(value).encode()]], dtype=np.object_)
        return np.array([[value]], dtype=NUMPY_DTYPES[control.datatype])

    async def _wait(self, seconds: float | None = None) -> None:
        self._changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), seconds)

    async def _dispatch(self) -> None:
        while True:
            wait = self._wait_for_company()
            if wait > 0:
                await self._wait(wait)
                continue
            chosen = self._next_batch()
            if chosen is None:
                await self._wait()  # a new request or a finished batch sets it
                continue
            instance, rows = chosen
            for seq, step in rows:
                if seq is not None:
                    seq.queue.popleft()
                    seq.running = True
                    self.queued -= 1
                self._feeds(seq, step)
            task = asyncio.create_task(self._run(rows, instance), name=f"qkv-{self.name}-sequence-batch")
            self._running.add(task)
            task.add_done_callback(self._running.discard)
            task.add_done_callback(functools.partial(self._batch_ended, rows))

    def _batch_ended(self, rows: list[tuple[_Sequence | None, SequenceStep]], task: asyncio.Task[None]) -> None:
        """Supervision of a batch: should its bookkeeping fail, its requests are answered, not left waiting,
        and the batcher stops (the sequences' state can no longer be trusted)."""
        if task.cancelled() or task.exception() is None:
            return
        self._task_ended(task)
        for _, step in rows:
            if step.future is not None and not step.future.done():
                step.future.set_exception(Unavailable(self.failure))

    async def _run(self, rows: list[tuple[_Sequence | None, SequenceStep]], instance: int) -> None:
        loop = asyncio.get_running_loop()
        steps = [step for _, step in rows]
        started = time.perf_counter()  # a metric's duration, not a decision: the real clock
        try:
            results = await loop.run_in_executor(self._executors[instance], self._compute, steps, instance)
        finally:
            self._idle.append(instance)
        self.observer.batch(len(steps), 0, 0, time.perf_counter() - started)
        now = self.clock()
        for (seq, step), result in zip(rows, results, strict=True):
            if seq is None:
                continue
            outcome = result if isinstance(result, BaseException) else self._store(seq, step, result)
            seq.running = False
            self._touch(seq, now)
            if step.end and not seq.queue:
                self._free(seq)
            assert step.future is not None
            if step.future.done():
                continue
            if isinstance(outcome, BaseException):
                step.future.set_exception(outcome)
            else:
                step.future.set_result(outcome)
        self._observe()
        self._changed.set()
        self._went_idle.set()

    def _store(self, seq: _Sequence, step: SequenceStep, result: dict[str, np.ndarray]) -> Any:
        """Keep the row's state outputs as the sequence's next state inputs; the outputs to answer with
        (a state output only when the client named it), or the error."""
        new: dict[str, np.ndarray] = {}
        for s in self.config.states:
            value = result.get(s.output_name)
            if value is None:
                return Internal(f"model '{self.name}' gave no state output '{s.output_name}'")
            want = NUMPY_DTYPES[s.datatype]
            fits = value.ndim == len(s.dims) + 1 and value.shape[0] == 1
            fits = fits and all(d < 0 or d == n for d, n in zip(s.dims, value.shape[1:], strict=False))
            if not fits or value.dtype != np.dtype(want):
                return Internal(
                    f"model '{self.name}': state output '{s.output_name}' is {value.dtype} {list(value.shape)}, "
                    f"the state is {s.datatype} [1, {', '.join(map(str, s.dims))}]"
                )
            new[s.input_name] = value
        added = sum(_nbytes(a) for a in new.values()) - seq.state_bytes
        over = self._over_state_bytes(seq, step.caller, added) if new else None
        if over is not None:
            error = ResourceExhausted(
                f"model '{self.name}': sequence {self._shown(seq.id)}'s state would bring {over}: the sequence is ended"
            )
            while seq.queue:  # its state can no longer be kept: the sequence ends here, and its queued requests
                queued = seq.queue.popleft()
                self.queued -= 1
                if queued.future is not None and not queued.future.done():
                    queued.future.set_exception(error)
            self._free(seq)
            return error
        if new:
            self._set_state(seq, new)
        hidden = {s.output_name for s in self.config.states} - set(step.outputs)
        return {k: v for k, v in result.items() if k not in hidden}

    def _over_state_bytes(self, seq: _Sequence, caller: Caller | None, added: int) -> str | None:
        """What `added` more bytes of the sequence's state would pass: max_state_bytes, or its caller's share."""
        bound = self.config.max_state_bytes
        if self.state_bytes + added > bound:
            held = self.state_bytes + added
            return f"the state held to {held:,} bytes, over sequence_batching.max_state_bytes {bound:,}"
        held = self.owned.get(seq.owner, (0, 0))[1] if seq.owner else 0
        if seq.owner and held + added > share_of(bound, caller):
            return (
                f"this caller's state to {held + added:,} bytes, over this caller's share of "
                f"sequence_batching.max_state_bytes {bound:,} (--token-share)"
            )
        return None

    def _compute(self, steps: list[SequenceStep], instance: int) -> list[Any]:
        """`run_batch`, a failure turned into each step's error: a runtime failure fails this batch only."""
        try:
            results = self.run_batch(steps, instance)
        except ServingError as e:
            return [e] * len(steps)
        except Exception as e:
            log.error("model '%s': sequence batch of %d failed: %s", self.name, len(steps), e)
            return [Internal(f"model '{self.name}' failed on this batch: {e}")] * len(steps)
        if len(results) != len(steps):
            return [Internal(f"model '{self.name}': {len(results)} results for {len(steps)} rows")] * len(steps)
        return results

    # --- shutdown --------------------------------------------------------------------------------

    async def close(self) -> None:
        """Refuse new requests, fail the queued ones (UNAVAILABLE), let the running batches finish, and free
        every sequence."""
        self._closed = True
        self._fail_queued(Unavailable(f"model '{self.name}' is shutting down"))
        if self._running:
            await asyncio.gather(*self._running, return_exceptions=True)
        for task in (self._dispatcher, self._reaper):
            if task is not None and not task.done():  # a task that died was read by `_task_ended`
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for seq in list(self.live.values()):
            self._free(seq)
        for e in self._executors:
            e.shutdown(wait=True)
