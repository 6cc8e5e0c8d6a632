# Over 500 lines: the decoding thread whole: one running batch that admission, each step's plan, both
# architectures' steps and the beams' rows all change.
"""The decoding engine: continuous batching of generation at the step level, one decoding thread.

Sequences join the running batch at any step and leave it as soon as they end; each keeps its own key/value
cache (one array a past input of the graph, (H, L, D)). A step (planning.py) decodes one token for every
sequence past its prompt and runs what the token budget leaves of waiting prompts:

- decoder-only: prompts in chunks over their cache so far. Rows of different lengths run in one call, the
  caches left-padded to the longest, the new tokens left-padded too, the attention mask zero on every pad
  and position_ids given explicitly, so a row's answer is what it would be alone.
- encoder-decoder: the encoder once per prompt (the step's new prompts batched, right-padded, sorted by
  length), then the decoder. The decoder with past is given a self-attention mask at load (masking.py):
  rows of different lengths run in one call as decoder-only rows do, the caches left-padded and the pads
  masked (T5's relative position bias moves with the pad, so only the pads need masking). A decoder whose
  graph the rewrite does not recognise takes no mask, and padding its cache would change the answer: its
  rows run in groups of equal cache length (sequences that joined at the same step decode together).

The cache is reserved in a memory budget when a sequence joins (prompt and max_tokens worth): a request
that cannot fit waits in the queue, one that could never fit is refused. A sequence whose client went
away (`cancel`) is dropped, and its cache freed, before the next step.

A beam search (num_beams N > 1, beams.py) reserves N caches and counts N rows of the running batch. Its
prompt runs as one row; from its first token on, its N beams are rows of the running batch beside the
others, sharing the prompt's cache; at each step the search picks the next beams and each continues its
parent's cache (fresh rows each step, so that nothing kept by row, such as an encoder-decoder group's
outputs, is taken for a reordered cache). The answer is one chunk at the end.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol, cast

import numpy as np

from service.decoding.choosing import Chooser
from service.decoding.detokenize import Detokenizer
from service.decoding.planning import Plan, plan_step, step_budget
from service.decoding.request import FinishReason, GenerationChunk, GenerationRequest
from service.decoding.resident import ResidentCaches
from service.decoding.steps import DecoderOnly, EncoderDecoder, StartsFromEncoder
from service.errors import DeadlineExceeded, Internal, ResourceExhausted, ServingError, Unavailable
from service.priority import ComputeThreads
from service.seq2seq.beams import BeamSearch, log_softmax

__all__ = ["Engine", "EngineObserver", "Sequence"]

log = logging.getLogger("qkv.generation")

Message = GenerationChunk | ServingError


class Outlet(Protocol):
    """Where a sequence's messages go: its request's asyncio.Queue, or what a caller that steps the engine
    itself reads them from."""

    def put_nowait(self, item: Message, /) -> None: ...


class EngineObserver(Protocol):
    """What the engine reports (the metrics module implements it)."""

    def step(self, running: int, tokens: int, cache_bytes: int, seconds: float) -> None: ...
    def held(self, running: int, cache_bytes: int) -> None:
        """The running batch and its cache now: after each step, and after sequences left between steps."""
        ...

    def first_token(self, seconds: float, queued: float) -> None: ...
    def answered(self, prompt_tokens: int, completion_tokens: int, seconds: float, first: float) -> None: ...


class _NoObserver:
    def step(self, running: int, tokens: int, cache_bytes: int, seconds: float) -> None: ...
    def held(self, running: int, cache_bytes: int) -> None: ...
    def first_token(self, seconds: float, queued: float) -> None: ...
    def answered(self, prompt_tokens: int, completion_tokens: int, seconds: float, first: float) -> None: ...


@dataclass(eq=False)
class Sequence:
    """One request in the engine: its prompt, its cache, its output so far, and where its chunks go."""

    request: GenerationRequest
    chooser: Chooser
    detokenizer: Detokenizer | None  # None: no text (g2p's words are token ids only)
    queue: Outlet  # the request's stream: its chunks, or the error
    reserved: int = 0  # cache bytes reserved in the budget
    arrived: float = field(default_factory=time.monotonic)
    joined: float = 0.0  # when it joined the running batch
    first: float = 0.0  # when its first token came
    done: int = 0  # prompt tokens in the cache (decoder-only) / 1 once encoded (encoder-decoder)
    cache: list[np.ndarray] = field(default_factory=list)
    output: list[int] = field(default_factory=list)
    cancelled: bool = False
    finished: bool = False
    cancelled_at: int = -1  # the engine's step count when its client went away, and when its cache was freed
    freed_at: int = -1
    # A beam search: the request's own sequence holds the search and its beams (the rows that run now); each
    # beam row names the request's sequence as its lead.
    search: BeamSearch | None = None
    beams: list[Sequence] = field(default_factory=list)
    lead: Sequence | None = None
    score: float = 0.0  # the chosen tokens' logits summed (their log-probability where the graph gives log-probs)
    attention: list[np.ndarray] | None = None  # a list: each output token's cross-attention row (g2p's graphs)
    tag: Any = None  # the caller's handle, opaque to the engine
    chunks: bool = True  # a chunk every step; False: the last one only (a caller that reads the answer whole)
    # Where its cache lies in the last step's outputs (an encoder-decoder's): the call's group and its row there
    slot: tuple[tuple[int, ...], int] | None = None

    @property
    def owner(self) -> Sequence:
        """The request's own sequence: itself, or a beam row's lead."""
        return self.lead or self

    @property
    def rows(self) -> int:
        """Rows of the running batch it accounts for: a beam search's own sequence its N beams."""
        return self.request.num_beams if self.lead is None else 1

    @property
    def prompt(self) -> tuple[int, ...]:
        return self.request.prompt_ids

    @property
    def length(self) -> int:
        """Its self-attention cache's length."""
        return int(self.cache[0].shape[1]) if self.cache else 0


class Engine:
    """One decoding thread stepping the running batch of one model instance."""

    def __init__(self, name: str, graph: DecoderOnly | EncoderDecoder, compute: ComputeThreads, eos: tuple[int, ...],
                 decoder_start: int, max_positions: int, cache_budget: int, step_tokens: int, max_running: int,
                 max_waiting: int, observer: EngineObserver | None = None, min_join: int = 1,
                 join_delay: float = 0.0) -> None:  # fmt: skip
        self.name, self.graph, self.compute, self.eos = name, graph, compute, frozenset(eos)
        self.decoder_start, self.max_positions = decoder_start, max_positions
        self.cache_budget, self.step_tokens = cache_budget, step_tokens
        self.max_running, self.max_waiting = max_running, max_waiting
        # An encoder-decoder whose decoder takes no self-attention mask runs its decoder rows in groups of equal
        # length: its new sequences join a running batch together, at least `min_join` of them (or fewer once
        # the oldest has waited `join_delay` s). A masked one's join at once.
        equal_lengths = isinstance(graph, EncoderDecoder) and not graph.masked
        self.min_join, self.join_delay = (min_join, join_delay) if equal_lengths else (1, 0.0)
        self.observer: EngineObserver = observer or _NoObserver()
        self.encoder_decoder = isinstance(graph, EncoderDecoder)
        # A decoder that also takes the first step: new prompts decode in the step's call (g2p's graphs)
        self.starts_from_encoder = isinstance(graph, StartsFromEncoder)
        # ... and grows caches in place: the running rows' caches stay in its buffers from step to step
        self.room = cast(StartsFromEncoder, graph).room if self.starts_from_encoder else 0
        self.resident: ResidentCaches[Sequence] | None = None
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.reserved = 0  # cache bytes reserved by the running sequences
        # An encoder-decoder's decoding groups of the last step (their sequences' ids): the encoder mask, the
        # next self-attention mask and the step's outputs, the next step's past if the group is the same.
        self._groups: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, list[np.ndarray]]] = {}
        self._next_groups: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, list[np.ndarray]]] = {}
        self.decode_seconds = 0.0  # a decoding call's time, smoothed (decoder-only)
        self.token_seconds = 0.0  # a prefill call's time per prompt token, smoothed
        self.steps = 0
        self._lock = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._outbox: list[tuple[Sequence, Message]] = []  # chunks of this step, handed over in one wake-up
        self._loop: asyncio.AbstractEventLoop | None = None
        self.failure = ""

    # --- the event loop's side --------------------------------------------------------------------------

    @cached_property
    def token_bytes(self) -> int:
        """A sequence's cache bytes per token (its decoder's keys and values in every layer)."""
        past = self.graph.past
        return sum(own for own in past.self_attention) * past.heads * past.head_dim * 4

    @cached_property
    def cross_bytes(self) -> int:
        """An encoder-decoder's cross-attention cache bytes per prompt token."""
        past = self.graph.past
        return sum(not own for own in past.self_attention) * past.heads * past.head_dim * 4

    def reservation(self, request: GenerationRequest) -> int:
        """The cache bytes a request reserves: its whole prompt and output, for each of its beams."""
        if self.encoder_decoder:
            one = (request.max_tokens + 1) * self.token_bytes + len(request.prompt_ids) * self.cross_bytes
        else:
            one = (len(request.prompt_ids) + request.max_tokens) * self.token_bytes
        return one * request.num_beams

    def submit(self, sequence: Sequence) -> None:
        """Queue `sequence`, or raise the refusal (ResourceExhausted: the queue is full or it can never fit)."""
        need = self.reservation(sequence.request)
        if need > self.cache_budget:
            raise ResourceExhausted(
                f"model '{self.name}': the request's key/value cache ({need:,} bytes for its prompt and max_tokens) "
                f"exceeds the cache budget of {self.cache_budget:,} bytes; ask for fewer max_tokens or a shorter prompt"
            )
        sequence.reserved = need
        with self._lock:
            if self.failure or self._closed:
                raise Unavailable(f"model '{self.name}': {self.failure or 'it is unloading'}")
            if len(self.waiting) >= self.max_waiting:
                raise ResourceExhausted(
                    f"model '{self.name}' is overloaded: {len(self.waiting)} requests wait for the running batch "
                    f"(limit {self.max_waiting})"
                )
            self.waiting.append(sequence)
            self._lock.notify()

    def cancel(self, sequence: Sequence) -> None:
        """The client went away: the sequence leaves, and its cache is freed, before the next step."""
        with self._lock:
            sequence.cancelled = True
            sequence.cancelled_at = self.steps
            self._lock.notify()

    def join(self, sequences: list[Sequence]) -> None:
        """`sequences` join the running batch at the next step, past the queue and the cache budget: for a caller
        that schedules its own requests and steps the engine itself, never starting its thread (g2p's scheduler).
        Their messages then reach their outlets during `step`, on the caller's thread."""
        if self.room and any(s.request.num_beams > 1 for s in sequences):
            raise ValueError(f"model '{self.name}': its decoder grows its caches in place: no beam search here")
        with self._lock:
            self.running.extend(sequences)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._thread = threading.Thread(target=self._work, args=(self.compute.reserve(1),), name=f"qkv-{self.name}-gen",
                                        daemon=True)  # fmt: skip
        self._thread.start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for s in self.waiting + self.running:
            self._send(s, Unavailable(f"model '{self.name}' is unloading"))
        self.waiting.clear()
        self.running.clear()
        self._flush()

    @property
    def cache_bytes(self) -> int:
        """Cache held now by the running sequences."""
        held = self.resident.nbytes if self.resident is not None and self.resident.rows else 0
        return held + sum(sum(a.nbytes for a in s.cache) for s in self.running)

    # --- the decoding thread ----------------------------------------------------------------------------

    def _send(self, s: Sequence, message: Message) -> None:
        self._outbox.append((s, message))

    def _flush(self) -> None:
        """Hand this step's chunks to the event loop: one wake-up for all of them."""
        out, self._outbox = self._outbox, []
        if not out:
            return

        def put() -> None:
            for s, message in out:
                s.queue.put_nowait(message)

        if self._loop is None:  # stepped by its caller, on the caller's thread: delivered now
            put()
        elif not self._loop.is_closed():
            self._loop.call_soon_threadsafe(put)

    def _work(self, slot: int) -> None:
        self.compute.lower_this_thread(slot)
        try:
            while True:
                with self._lock:
                    while not self._closed and not self._ready():
                        self._lock.wait()
                    if self._closed:
                        return
                    self._admit()
                self.step()
        except Exception as e:  # a bug: every request hears it rather than waiting forever
            log.exception("model '%s': the decoding thread failed", self.name)
            with self._lock:
                self.failure = f"the decoding thread failed: {e}"
                for s in self.waiting + self.running:
                    self._send(s, Internal(f"model '{self.name}': {self.failure}"))
                self.waiting.clear()
                self.running.clear()
                self._flush()

    def _ready(self) -> bool:
        if self._drop_gone():  # no step may follow (the batch emptied): say what is held now
            self.observer.held(len(self.running), self.cache_bytes)
        self._flush()
        return bool(self.running) or bool(self.waiting)

    def _drop_gone(self) -> bool:
        """Sequences whose client left or whose deadline passed leave, their caches freed; whether any ran."""
        now = time.monotonic()
        left = False
        for group in (self.waiting, self.running):
            for s in [
                s for s in group
                if s.owner.cancelled or (s.request.deadline is not None and now >= s.request.deadline)
            ]:  # fmt: skip
                group.remove(s)
                if group is self.running:
                    self.reserved -= s.reserved
                    left = True
                s.cache = []
                s.freed_at = s.owner.freed_at = self.steps
                if not s.owner.cancelled and not s.owner.finished:  # a beam search's rows: told once
                    s.owner.finished = True
                    self._send(s, DeadlineExceeded(f"model '{self.name}': the request's deadline passed"))
        return left

    def _admit(self) -> None:
        """Waiting sequences join, in order, while the running batch and the cache budget have room."""
        if self.encoder_decoder and self.running and self.waiting:
            room = min(self.min_join, self.max_running - len(self.running))
            if len(self.waiting) < room and time.monotonic() - self.waiting[0].arrived < self.join_delay:
                return  # a few more, and they decode as one group
        while self.waiting:
            s = self.waiting[0]
            rows = sum(r.rows for r in self.running)  # a beam search's N beams count N
            if rows and rows + s.rows > self.max_running:
                break  # (one wider than the whole batch joins an empty one)
            if self.reserved + s.reserved > self.cache_budget and self.running:
                break
            self.waiting.pop(0)
            self.reserved += s.reserved
            s.joined = time.monotonic()
            self.running.append(s)

    def remaining(self, s: Sequence) -> int:
        """Prompt tokens a sequence has still to run (an encoder-decoder's prompt counts until encoded)."""
        return len(s.prompt) - s.done if not self.encoder_decoder else (len(s.prompt) if not s.done else 0)

    def step(self) -> Plan:
        """One step of the running batch (on the decoding thread; tests call it directly)."""
        with self._lock:
            self._drop_gone()
            running = list(self.running)
        remaining = [self.remaining(s) for s in running]
        budget = self.step_tokens
        if not self.encoder_decoder:
            decoding = remaining.count(0)
            budget = step_budget(decoding, self.step_tokens, self.decode_seconds, self.token_seconds)
        plan = plan_step(remaining, budget, chunked=not self.encoder_decoder)
        started = time.perf_counter()
        try:
            if self.encoder_decoder:
                self._seq2seq_step(running, plan)
            else:
                self._causal_step(running, plan)
        except Exception as e:  # onnxruntime failed: the step's sequences hear it, the others go on
            log.exception("model '%s': a decoding step failed", self.name)
            self.resident = None  # what it held is the step's rows', which all fail
            error = Internal(f"model '{self.name}': decoding failed: {e}")
            for i in list(plan.decode) + [i for i, _ in plan.prefill]:
                self._finish(running[i], None, error)
        self.steps += 1
        with self._lock:
            self.running = [s for s in self.running if not s.finished]
            self.reserved = sum(s.reserved for s in self.running)
            cache = self.cache_bytes
            held = len(self.running)
        self._flush()
        self.observer.step(len(running), plan.tokens, cache, time.perf_counter() - started)
        self.observer.held(held, cache)
        return plan

    # --- decoder-only -----------------------------------------------------------------------------------

    def _causal_step(self, running: list[Sequence], plan: Plan) -> None:
        if plan.decode:
            started = time.perf_counter()
            for group in _by_length([running[i] for i in plan.decode]):
                self._causal_rows([(s, [s.output[-1]]) for s in group], [True] * len(group))
            self.decode_seconds = _smoothed(self.decode_seconds, time.perf_counter() - started)
        if plan.prefill:
            rows, last = [], []
            for i, n in plan.prefill:
                s = running[i]
                rows.append((s, list(s.prompt[s.done : s.done + n])))
                last.append(s.done + n == len(s.prompt))
            started = time.perf_counter()
            self._causal_rows(rows, last)
            tokens = sum(n for _, n in plan.prefill)
            self.token_seconds = _smoothed(self.token_seconds, (time.perf_counter() - started) / tokens)

    def _causal_rows(self, rows: list[tuple[Sequence, list[int]]], emits: list[bool]) -> None:
        """Run `rows` (a sequence and its new tokens) in one call; each whose flag is set chooses its next token."""
        graph = cast(DecoderOnly, self.graph)
        b = len(rows)
        lengths = [s.length for s, _ in rows]
        p, t = max(lengths), max(len(new) for _, new in rows)
        ids = np.zeros((b, t), dtype=np.int64)
        positions = np.zeros((b, t), dtype=np.int64)
        mask = np.zeros((b, p + t), dtype=np.int64)
        h, d = graph.past.heads, graph.past.head_dim
        past = [np.zeros((b, h, p, d), dtype=graph.dtype) for _ in graph.past.inputs]
        for r, ((s, new), n) in enumerate(zip(rows, lengths, strict=True)):
            k = len(new)
            ids[r, t - k :] = new
            positions[r, t - k :] = np.arange(n, n + k)
            mask[r, p - n : p] = 1
            mask[r, p + t - k :] = 1
            for a, c in zip(past, s.cache if n else (), strict=False):
                a[r, :, p - n :] = c
        logits, present = graph.run(ids, mask, positions, past)
        best = logits[:, -1].argmax(axis=-1).tolist()  # greedy rows' tokens, in one call
        for r, ((s, new), n) in enumerate(zip(rows, lengths, strict=True)):
            if len(new) == t:  # its positions are the last n + t: a view, copied once, into the next step's past
                s.cache = [a[r, :, p - n :] for a in present]
            else:
                keep = np.flatnonzero(mask[r])
                s.cache = [np.ascontiguousarray(a[r][:, keep]) for a in present]
            if s.done < len(s.prompt):
                s.done += len(new)
            if emits[r]:
                self._advance(s, logits[r, -1], best[r])

    # --- encoder-decoder --------------------------------------------------------------------------------

    def _seq2seq_step(self, running: list[Sequence], plan: Plan) -> None:
        graph = cast(EncoderDecoder, self.graph)
        rows = [running[i] for i in plan.decode]
        new = sorted((running[i] for i, _ in plan.prefill), key=lambda s: len(s.prompt))
        if new and self.starts_from_encoder:  # their first step is in the decoding call, beside the others'
            self._seq2seq_encode(new)
            rows, new = rows + new, []
        if self.room:  # every row in one call, over the caches its buffers hold
            if rows:
                self._resident_decode(rows)
            return
        if graph.masked:  # rows of different lengths in one call, left-padded (far apart ones apart)
            groups = _by_length(rows)
        else:  # a pad would change the answer: rows of equal length together
            same: dict[int, list[Sequence]] = {}
            for s in rows:
                same.setdefault(s.length, []).append(s)
            groups = list(same.values())
        self._next_groups = {}
        for group in groups:
            self._seq2seq_decode(group)
        self._groups = self._next_groups  # what the next step may take as it is
        if new:
            self._seq2seq_start(new)

    def _encoded(self, new: list[Sequence]) -> tuple[Any, np.ndarray]:
        """The new prompts, right-padded, through the encoder: its output and the prompts' mask."""
        graph = cast(EncoderDecoder, self.graph)
        b, width = len(new), max(len(s.prompt) for s in new)
        ids = np.zeros((b, width), dtype=np.int64)
        mask = np.zeros((b, width), dtype=np.int64)
        for r, s in enumerate(new):
            ids[r, : len(s.prompt)] = s.prompt
            mask[r, : len(s.prompt)] = 1
        return graph.encode(ids, mask), mask

    def _seq2seq_encode(self, new: list[Sequence]) -> None:
        """Encode the new prompts: each holds its cross-attention arrays and an empty self-attention cache."""
        graph = cast(EncoderDecoder, self.graph)
        hidden, _ = self._encoded(new)
        first = cast(StartsFromEncoder, graph).first_cache(hidden)
        for r, s in enumerate(new):
            n = len(s.prompt)
            s.cache = [a[r] if own else a[r][:, :n] for a, own in zip(first, graph.past.self_attention, strict=True)]
            s.done = 1

    def _seq2seq_start(self, new: list[Sequence]) -> None:
        """Encode the new prompts (right-padded) and run the decoder's first step."""
        graph = cast(EncoderDecoder, self.graph)
        hidden, mask = self._encoded(new)
        start = np.full((len(new), 1), self.decoder_start, dtype=np.int64)
        logits, present = graph.start(start, hidden, mask)
        for r, s in enumerate(new):
            n = len(s.prompt)
            s.cache = [np.ascontiguousarray(a[r] if own else a[r][:, :n])
                       for a, own in zip(present, graph.past.self_attention, strict=True)]  # fmt: skip
            s.done = 1
            self._advance(s, logits[r, -1])

    def _seq2seq_decode(self, group: list[Sequence]) -> None:
        """One token for a group of sequences: their decoder caches stacked, left-padded to the longest (a
        decoder that takes no self-attention mask gets groups of equal length), the encoder's right-padded. A
        group that decoded together at the last step takes that step's outputs as they are (nothing copied)."""
        graph = cast(EncoderDecoder, self.graph)
        key = tuple(id(s) for s in group)
        lengths = [s.length for s in group]
        kept = self._groups.get(key)
        mask, self_mask, past = kept if kept is not None else self._stacked(group, lengths)
        p = self_mask.shape[1] - 1  # the cache's positions in this call, pads included
        logits, present = graph.step(self._last_tokens(group), mask, past, self_mask)
        grown = np.ones((self_mask.shape[0], self_mask.shape[1] + 1), dtype=np.int64)  # the next step's: one more
        grown[:, :-1] = self_mask
        self._next_groups[key] = (mask, grown, present)
        for r, (s, n) in enumerate(zip(group, lengths, strict=True)):
            s.cache = [a[r, :, p - n :] if own else c
                       for a, c, own in zip(present, s.cache, graph.past.self_attention, strict=True)]  # fmt: skip
            s.slot = (key, r)
        self._decoded(group, logits)

    def _resident_decode(self, rows: list[Sequence]) -> None:
        """One token for every row, their caches resident in the engine's buffers (resident.py)."""
        graph = cast(EncoderDecoder, self.graph)
        if self.resident is None:
            self.resident = ResidentCaches[Sequence](graph.past, graph.dtype, self.room)
        resident = self.resident
        resident.hold(rows)
        mask, self_mask, past = resident.past()
        group = list(resident.rows)
        logits, _ = graph.step(self._last_tokens(group), mask, past, self_mask)
        resident.stepped()
        self._decoded(group, logits)

    def _last_tokens(self, group: list[Sequence]) -> np.ndarray:
        """(B, 1): each row's last token, the decoder's start token before its first."""
        return np.array([[s.output[-1] if s.output else self.decoder_start] for s in group], dtype=np.int64)

    def _decoded(self, group: list[Sequence], logits: np.ndarray) -> None:
        """After an encoder-decoder's decoding call: each row keeps the call's cross-attention row where it asks
        for it and the graph gives it, and advances by its next token (greedy rows' from one argmax)."""
        attention = cast(StartsFromEncoder, self.graph).attention() if self.starts_from_encoder else None
        best = logits[:, -1].argmax(axis=-1).tolist()
        for r, s in enumerate(group):
            if s.attention is not None and attention is not None:
                s.attention.append(attention[r, : len(s.prompt)].copy())
            self._advance(s, logits[r, -1], best[r])

    def _stacked(self, group: list[Sequence], lengths: list[int]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """A group's encoder mask, self-attention mask (B, P+1) and past: caches left-padded to the longest (at
        least one position: a masked pad before a first step), the encoder's right-padded. Rows that decoded
        together at the last step (most of a running batch's) are copied from that step's outputs as one block."""
        graph = cast(EncoderDecoder, self.graph)
        own = graph.past.self_attention
        b, p, width = len(group), max(1, *lengths), max(len(s.prompt) for s in group)
        mask = np.zeros((b, width), dtype=np.int64)
        self_mask = np.zeros((b, p + 1), dtype=np.int64)  # the cache and the new token: 1 real, 0 a pad
        blocks: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for r, (s, n) in enumerate(zip(group, lengths, strict=True)):
            mask[r, : len(s.prompt)] = 1
            self_mask[r, p - n :] = 1
            if s.slot is not None and s.slot[0] in self._groups:
                blocks.setdefault(s.slot[0], []).append((r, s.slot[1]))
        h, d = graph.past.heads, graph.past.head_dim
        past = [np.zeros((b, h, p if o else width, d), dtype=graph.dtype) for o in own]
        copied: set[int] = set()
        for last, pairs in blocks.items():
            if len(pairs) < 2:
                continue
            rows, was = np.array([r for r, _ in pairs]), np.array([r for _, r in pairs])
            m = max(lengths[r] for r, _ in pairs)  # the block's longest cache: its rows' last m positions
            for a, before, o in zip(past, self._groups[last][2], own, strict=True):
                if o:
                    a[rows, :, p - m :] = before[was, :, before.shape[2] - m :]
                else:
                    w = min(before.shape[2], width)
                    a[rows, :, :w] = before[was, :, :w]
            copied.update(rows.tolist())
        for r, (s, n) in enumerate(zip(group, lengths, strict=True)):
            if r in copied:
                continue
            for a, c, o in zip(past, s.cache, own, strict=True):
                if o:
                    a[r, :, p - n :] = c
                else:
                    a[r, :, : len(s.prompt)] = c
        return mask, self_mask, past

    # --- choosing and answering -------------------------------------------------------------------------

    def _advance(self, s: Sequence, logits: np.ndarray, best: int | None = None) -> None:
        """Choose `s`'s next token from its logits (`best`: their argmax, when the call's rows took it at once),
        hand its chunk over, and end it if it is done."""
        request = s.request
        if request.num_beams > 1:
            self._beam_advance(s, logits)
            return
        chooser = s.chooser
        if best is not None and chooser.rng is None and chooser.penalty == 1.0:  # greedy: the argmax as it is
            token = best
        else:
            token = chooser.choose(logits, self._seen(s) if chooser.penalty != 1.0 else ())
        s.score += float(logits[token])
        first = not s.output
        s.output.append(token)
        if first:
            s.first = time.monotonic()
            self.observer.first_token(s.first - s.arrived, s.joined - s.arrived)
        reason: FinishReason | None = None
        special = (token in self.eos and not request.ignore_eos) or token in request.stop_token_ids
        detokenizer = s.detokenizer
        text = "" if special or detokenizer is None else detokenizer.add(token)
        if special or (detokenizer is not None and detokenizer.stopped):
            reason = "stop"
        elif len(s.output) >= request.max_tokens or (
            self.max_positions and len(s.prompt) + len(s.output) >= self.max_positions
        ):
            reason = "length"
        if reason is not None and detokenizer is not None:
            text += detokenizer.flush()
        if reason is None and not s.chunks:
            return
        chunk = GenerationChunk((token,), text, reason, len(s.prompt), len(s.output))
        if reason is not None:
            self._finish(s, chunk, None)
        else:
            self._send(s, chunk)

    def _seen(self, s: Sequence) -> tuple[int, ...]:
        """The tokens the repetition penalty covers, as transformers' covers its decoder's input ids: the prompt
        and the output (decoder-only), the decoder's start token and the output (encoder-decoder)."""
        return (self.decoder_start, *s.output) if self.encoder_decoder else (*s.prompt, *s.output)

    def _beam_advance(self, s: Sequence, logits: np.ndarray) -> None:
        """Offer beam row `s`'s log-probs to its search; once every beam's are in, step the search: the next
        beams (fresh rows, each continuing its parent's cache) take the place of these, or the answer goes out."""
        lead, request = s.owner, s.request
        if lead.search is None:  # the prompt's row: the search starts (its decoding, for time per output token)
            lead.first = time.monotonic()
            eos = (self.eos if not request.ignore_eos else frozenset()) | frozenset(request.stop_token_ids)
            room = self.max_positions - len(s.prompt) if self.max_positions else request.max_tokens
            lead.search = BeamSearch(request.num_beams, eos, min(request.max_tokens, room), request.length_penalty,
                                     request.early_stopping)  # fmt: skip
        search = lead.search
        scores = log_softmax(logits)
        if s.chooser.penalty != 1.0:  # logits processors run on the log-probs in transformers' beam search
            scores = s.chooser.scores(scores, self._seen(s))
        rows = lead.beams or [lead]
        if not search.offer(rows.index(s), scores):
            return
        choices = search.step()
        if not choices:
            self._beam_answer(lead)
            return
        beams = [
            Sequence(request, lead.chooser, lead.detokenizer, lead.queue, lead.reserved // request.num_beams,
                     lead.arrived, lead.joined, done=rows[p].done, cache=rows[p].cache, output=[*rows[p].output, t],
                     lead=lead)
            for p, t in choices
        ]  # fmt: skip
        if lead.beams:
            for old in lead.beams:
                old.finished, old.cache = True, []
        else:  # the prompt's row leaves: its beams hold its reservation
            self.running.remove(lead)
            lead.cache = []
        lead.beams = beams
        self.running.extend(beams)

    def _beam_answer(self, lead: Sequence) -> None:
        """A beam search's answer: its best hypothesis, in one chunk."""
        assert lead.search is not None
        tokens = lead.search.best()[0].tokens
        lead.output = list(tokens)
        self.observer.first_token(time.monotonic() - lead.arrived, lead.joined - lead.arrived)  # the client's
        ended = bool(tokens) and tokens[-1] in lead.search.eos
        body = list(tokens[:-1] if ended else tokens)
        text = lead.detokenizer.decode(body) if lead.detokenizer is not None else ""
        reason: FinishReason = "stop" if ended else "length"
        self._finish(lead, GenerationChunk(tokens, text, reason, len(lead.prompt), len(tokens)), None)

    def _finish(self, s: Sequence, chunk: GenerationChunk | None, error: ServingError | None) -> None:
        if s.owner.beams or s.lead is not None:  # a beam search: all its rows leave, its request hears once
            s = s.owner
            if s.finished:
                return
            for row in s.beams:
                row.finished, row.cache = True, []
        s.finished = True
        s.cache = []
        if error is not None:
            self._send(s, error)
            return
        assert chunk is not None
        self._send(s, chunk)
        self.observer.answered(len(s.prompt), len(s.output), time.monotonic() - s.arrived, s.first - s.arrived)


def _smoothed(mean: float, value: float) -> float:
    """An exponential moving average (the first value taken as it is)."""
    return value if mean == 0 else 0.5 * mean + 0.5 * value


PAD_SLACK = 64  # cache positions a decoding row may be padded by, besides doubling its length


def _by_length(rows: list[Sequence]) -> list[list[Sequence]]:
    """Decoding rows in groups that run as one call each: sorted by cache length, a new group where a row
    is over twice the group's shortest (plus PAD_SLACK), so a long sequence does not pad every short one
    to its length (15 rows of 200 beside one of 2,000 cost 45 ms as one call, 6 ms as two)."""
    groups: list[list[Sequence]] = []
    for s in sorted(rows, key=lambda s: s.length):
        if groups and s.length <= 2 * groups[-1][0].length + PAD_SLACK:
            groups[-1].append(s)
        else:
            groups.append([s])
    return groups
