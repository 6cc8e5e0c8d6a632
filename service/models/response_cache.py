"""The response cache: answers kept by what determines them, bounded in bytes, shared by every model.

A key is a digest of everything that changes an answer (the model and its version, each input's name,
datatype, shape and bytes, the outputs asked for and the parameters that matter); the caller builds it
with `key()`. Only a computation that succeeded is kept. Identical requests in flight at once are computed
once: the later ones wait for the first's answer (and share its failure, which is not kept). The first
leaving strands no one: the computation goes on while any request waits on it, and one that ended with
the request that started it (cancelled, or past its deadline) is started again by a request still
waiting, with its own deadline.

With isolated tokens (--isolate-tokens, service/callers.py), a caller's requests reach only the entries its
own requests made (its caller's name is part of the key), unless the operator shares them across callers
(--cache-across-tokens); either way a caller's statistics count its own lookups alone, so `cache_hit`
says nothing of what another token asked.

Memory is one server-wide bound (`--cache-size`): least recently used entries go first, so a client can
push others' entries out only by sending traffic of its own, at most its own bytes' worth. A version's
entries go when it is unloaded or replaced (`drop`).
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np

from service.callers import CALLER, Caller
from service.errors import Cancelled, DeadlineExceeded

__all__ = ["CacheCounts", "CacheObserver", "ResponseCache", "deep_size", "key"]

V = TypeVar("V")
# Bytes counted per entry beyond its value: the key (a 20-byte digest), its slot in the ordered dict, the entry.
ENTRY_OVERHEAD = 256
_INLINE_VALUES = 32  # an instance's inline attribute array's header (CPython 3.11), beyond its pointers


class CacheObserver(Protocol):
    """Where the cache reports (the server's metrics): per model, as it happens."""

    def looked_up(self, model: str, hit: bool, n: int = 1) -> None: ...
    def inserted(self, model: str, size: int) -> None: ...
    def evicted(self, model: str, size: int) -> None: ...
    def dropped(self, size: int) -> None: ...


@dataclass
class CacheCounts:
    """One model's cache statistics (Triton's cache_hit / cache_miss, and what the metrics show)."""

    hits: int = 0
    misses: int = 0
    insertions: int = 0
    evictions: int = 0
    bytes: int = 0
    entries: int = 0


def deep_size(value: object) -> int:
    """The bytes `value` holds in memory: sys.getsizeof of it and of every object it reaches (containers'
    items, a dataclass's fields, a numpy array's data, or a view's base, and an object array's elements),
    each counted once. CPython's shared small integers and singletons cost an entry nothing."""
    seen: set[int] = set()
    total, stack = 0, [value]
    while stack:
        obj = stack.pop()
        if obj is None or obj is True or obj is False or id(obj) in seen:
            continue
        if isinstance(obj, int) and -5 <= obj <= 256:
            continue
        seen.add(id(obj))
        total += sys.getsizeof(obj)
        if isinstance(obj, np.ndarray):
            if obj.base is not None:  # a view: its data is its base's, which it keeps alive
                stack.append(obj.base)
            elif obj.dtype.kind == "O":  # BYTES: an object each (counted each, however shared)
                total += sum(map(sys.getsizeof, obj.reshape(-1).tolist()))
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset):
            stack.extend(obj)
        elif is_dataclass(obj):
            # its attributes: a pointer each in the instance (CPython 3.11 keeps them inline, which getsizeof
            # leaves out), and the values they point to
            names = [f.name for f in fields(obj)]
            total += 8 * len(names) + (0 if hasattr(type(obj), "__slots__") else _INLINE_VALUES)
            stack.extend(getattr(obj, n) for n in names)
    return total


def key(parts: Iterable[bytes | str | int]) -> bytes:
    """A digest of `parts`, each length-prefixed so that no two sequences of parts share one."""
    h = hashlib.blake2b(digest_size=20)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


@dataclass(slots=True)
class _Entry(Generic[V]):
    value: V
    size: int
    model: str
    version: str


def _ended_with_its_owner(error: BaseException) -> bool:
    """Whether a computation failed because of the request that started it, not of what it computes: it was
    cancelled (its client left), or that request's deadline passed."""
    return isinstance(error, asyncio.CancelledError | DeadlineExceeded | Cancelled)


@dataclass
class _Flight(Generic[V]):
    """One computation in flight, and how many requests wait on it."""

    task: asyncio.Future[V]
    waiters: int = 0

    async def wait(self, deadline: float | None) -> V:
        """The computation's answer, waited for until `deadline` at most; the last to leave cancels it."""
        self.waiters += 1
        try:
            if deadline is None:
                return await asyncio.shield(self.task)
            try:
                return await asyncio.wait_for(asyncio.shield(self.task), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if self.task.done():  # (the computation's own failure, not this wait's end)
                    raise
                raise DeadlineExceeded("the request's deadline passed before its answer was computed") from None
        finally:
            self.waiters -= 1
            if not self.waiters and not self.task.done():
                self.task.cancel()


@dataclass
class ResponseCache(Generic[V]):
    """At most `capacity` bytes of answers; `observer` hears of every lookup, insertion and eviction."""

    capacity: int
    observer: CacheObserver | None = None
    across_callers: bool = False  # with --isolate-tokens: every caller's requests reach every entry
    _entries: OrderedDict[bytes, _Entry[V]] = field(default_factory=OrderedDict)
    _inflight: dict[bytes, _Flight[V]] = field(default_factory=dict)
    _counts: dict[tuple[str, str], CacheCounts] = field(default_factory=dict)
    _callers: dict[tuple[str, str, str], CacheCounts] = field(default_factory=dict)  # each caller's lookups
    held: int = 0  # bytes of every entry, overhead included

    def counts(self, model: str, version: str, caller: Caller | None = None) -> CacheCounts:
        """One model version's statistics (kept until the version is dropped); with a `caller` (isolated
        tokens), the hits and misses of that caller's own lookups alone."""
        if caller is not None:
            return self._callers.get((model, version, caller.name)) or CacheCounts()
        return self._counts.setdefault((model, version), CacheCounts())

    def _scoped(self, k: bytes) -> bytes:
        """The key a lookup of `k` reaches: with isolated tokens (a CALLER set), that caller's own, unless the
        entries are shared across callers."""
        caller = CALLER.get()
        return k if caller is None or self.across_callers else key([caller.name, k])

    def get(self, k: bytes, model: str, version: str) -> V | None:
        """The kept answer for `k`, counted as a hit or a miss."""
        return self.get_many([k], model, version)[0]

    def get_many(self, keys: list[bytes], model: str, version: str) -> list[V | None]:
        """`get` for each of `keys` (g2p's words), counted once for the lot."""
        entries, found = self._entries, []
        for k in keys:
            k = self._scoped(k)
            entry = entries.get(k)
            if entry is not None:
                entries.move_to_end(k)
            found.append(entry.value if entry is not None else None)
        hits = sum(v is not None for v in found)
        self._looked_up(model, version, True, hits)
        self._looked_up(model, version, False, len(keys) - hits)
        return found

    def put(self, k: bytes, value: V, size: int, model: str, version: str) -> None:
        """Keep `value` (`size` bytes), pushing out the least recently used until it fits; one larger than
        the whole bound is not kept."""
        self._put(self._scoped(k), value, size, model, version)

    def _put(self, k: bytes, value: V, size: int, model: str, version: str) -> None:
        total = size + ENTRY_OVERHEAD
        if total > self.capacity or k in self._entries:
            return
        while self.held + total > self.capacity:
            _, old = self._entries.popitem(last=False)
            self._forget(old, evicted=True)
        self._entries[k] = _Entry(value, total, model, version)
        self.held += total
        c = self.counts(model, version)
        c.insertions, c.bytes, c.entries = c.insertions + 1, c.bytes + total, c.entries + 1
        if self.observer is not None:
            self.observer.inserted(model, total)

    async def get_or_compute(
        self,
        k: bytes,
        model: str,
        version: str,
        compute: Callable[[], Awaitable[V]],
        size_of: Callable[[V], int],
        deadline: float | None = None,
    ) -> tuple[V, bool]:
        """The answer for `k` and whether it came from the cache (kept, or computed for a request that
        was in flight with the same key); else computed once, kept if it succeeds.

        The computation is a task of its own, which every request with the key waits on, the first
        included: it goes on while any of them waits, and is cancelled when the last leaves. A request
        waits until its own `deadline` (monotonic seconds) at most. When the computation ends with the
        request that started it (cancelled, or past that request's deadline), a request still waiting
        computes again, with its own `compute` and deadline: no one is stranded by another's leaving."""
        k = self._scoped(k)
        entry = self._entries.get(k)
        flight = self._inflight.get(k)
        self._looked_up(model, version, entry is not None or flight is not None)
        if entry is not None:
            self._entries.move_to_end(k)
            return entry.value, True
        while True:
            mine = flight is None
            if flight is None:
                flight = self._start(k, model, version, compute, size_of)
            try:
                return await flight.wait(deadline), not mine
            except BaseException as e:
                # Shared: a failure of the computation itself, or this request's own end (it was cancelled, or
                # its deadline passed: the computation goes on for the others).
                current = asyncio.current_task()
                leaving = current is not None and current.cancelling() > 0  # this request too, at the same time
                if mine or leaving or not flight.task.done() or not _ended_with_its_owner(e):
                    raise
            flight = self._inflight.get(k)  # another waiter may have started it again already

    def _start(
        self, k: bytes, model: str, version: str, compute: Callable[[], Awaitable[V]], size_of: Callable[[V], int]
    ) -> _Flight[V]:
        """`compute` as the task every request for `k` waits on; its answer kept when it succeeds."""
        flight = _Flight(asyncio.ensure_future(compute()))
        self._inflight[k] = flight

        def landed(task: asyncio.Future[V]) -> None:
            if self._inflight.get(k) is flight:
                del self._inflight[k]
            if task.cancelled():
                return
            if task.exception() is None:  # (retrieved: a failure no one waits for is no "never retrieved" error)
                value = task.result()
                self._put(k, value, size_of(value), model, version)

        flight.task.add_done_callback(landed)
        return flight

    def drop(self, model: str, version: str) -> int:
        """Forget a version's entries and statistics: it was unloaded or replaced. Returns the bytes freed."""
        gone = [k for k, e in self._entries.items() if e.model == model and e.version == version]
        freed = 0
        for k in gone:
            entry = self._entries.pop(k)
            self._forget(entry, evicted=False)
            freed += entry.size
        self._counts.pop((model, version), None)
        for c in [c for c in self._callers if c[:2] == (model, version)]:
            del self._callers[c]
        if freed and self.observer is not None:
            self.observer.dropped(freed)
        return freed

    def _forget(self, entry: _Entry[V], evicted: bool) -> None:
        self.held -= entry.size
        c = self.counts(entry.model, entry.version)
        c.bytes, c.entries = c.bytes - entry.size, c.entries - 1
        if evicted:
            c.evictions += 1
            if self.observer is not None:
                self.observer.evicted(entry.model, entry.size)

    def _looked_up(self, model: str, version: str, hit: bool, n: int = 1) -> None:
        if not n:
            return
        caller = CALLER.get()
        counted = [self.counts(model, version)]
        if caller is not None:  # isolated tokens: the caller's own lookups too, which its statistics show
            counted.append(self._callers.setdefault((model, version, caller.name), CacheCounts()))
        for c in counted:
            if hit:
                c.hits += n
            else:
                c.misses += n
        if self.observer is not None:
            self.observer.looked_up(model, hit, n)
