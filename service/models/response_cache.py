"""The response cache: answers kept by what determines them, bounded in bytes, shared by every model.

A key is a digest of everything that changes an answer (the model and its version, each input's name,
datatype, shape and bytes, the outputs asked for and the parameters that matter); the caller builds it
with `key()`. Only a computation that succeeded is kept. Identical requests in flight at once are computed
once: the later ones wait for the first's answer (and share its failure, which is not kept).

Memory is one server-wide bound (`--cache-size`): least recently used entries go first, so a client can
push others' entries out only by sending traffic of its own, at most its own bytes' worth. A version's
entries go when it is unloaded or replaced (`drop`).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

__all__ = ["CacheCounts", "CacheObserver", "ResponseCache", "key"]

V = TypeVar("V")
ENTRY_OVERHEAD = 256  # bytes counted per entry beyond its value: the key, the bookkeeping


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


def key(parts: Iterable[bytes | str | int]) -> bytes:
    """A digest of `parts`, each length-prefixed so that no two sequences of parts share one."""
    h = hashlib.blake2b(digest_size=20)
    for p in parts:
        b = p if isinstance(p, bytes) else str(p).encode("utf-8", "surrogatepass")
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.digest()


@dataclass
class _Entry(Generic[V]):
    value: V
    size: int
    model: str
    version: str


@dataclass
class ResponseCache(Generic[V]):
    """At most `capacity` bytes of answers; `observer` hears of every lookup, insertion and eviction."""

    capacity: int
    observer: CacheObserver | None = None
    _entries: OrderedDict[bytes, _Entry[V]] = field(default_factory=OrderedDict)
    _inflight: dict[bytes, asyncio.Future[V]] = field(default_factory=dict)
    _counts: dict[tuple[str, str], CacheCounts] = field(default_factory=dict)
    held: int = 0  # bytes of every entry, overhead included

    def counts(self, model: str, version: str) -> CacheCounts:
        """One model version's statistics (kept until the version is dropped)."""
        return self._counts.setdefault((model, version), CacheCounts())

    def get(self, k: bytes, model: str, version: str) -> V | None:
        """The kept answer for `k`, counted as a hit or a miss."""
        return self.get_many([k], model, version)[0]

    def get_many(self, keys: list[bytes], model: str, version: str) -> list[V | None]:
        """`get` for each of `keys` (g2p's words), counted once for the lot."""
        entries, found = self._entries, []
        for k in keys:
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
        self, k: bytes, model: str, version: str, compute: Callable[[], Awaitable[V]], size_of: Callable[[V], int]
    ) -> tuple[V, bool]:
        """The answer for `k` and whether it came from the cache (kept, or computed for a request that
        was in flight with the same key); else computed once, kept if it succeeds."""
        entry = self._entries.get(k)
        running = self._inflight.get(k)
        self._looked_up(model, version, entry is not None or running is not None)
        if entry is not None:
            self._entries.move_to_end(k)
            return entry.value, True
        if running is not None:  # an identical request is computing: share its answer (its failure too)
            return await asyncio.shield(running), True
        future: asyncio.Future[V] = asyncio.get_running_loop().create_future()
        self._inflight[k] = future
        try:
            value = await compute()
        except BaseException as e:
            if not future.done():
                future.set_exception(e)
                future.exception()  # the waiters, if any, re-raise it; none is not an unretrieved error
            raise
        finally:
            self._inflight.pop(k, None)
        future.set_result(value)
        self.put(k, value, size_of(value), model, version)
        return value, False

    def drop(self, model: str, version: str) -> int:
        """Forget a version's entries and statistics: it was unloaded or replaced. Returns the bytes freed."""
        gone = [k for k, e in self._entries.items() if e.model == model and e.version == version]
        freed = 0
        for k in gone:
            entry = self._entries.pop(k)
            self._forget(entry, evicted=False)
            freed += entry.size
        self._counts.pop((model, version), None)
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
        c = self.counts(model, version)
        if hit:
            c.hits += n
        else:
            c.misses += n
        if self.observer is not None:
            self.observer.looked_up(model, hit, n)
