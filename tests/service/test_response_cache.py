"""The response cache on its own: bounded in bytes whatever comes, least recently used out first, only
successes kept, identical requests in flight computed once, a version's entries dropped with it."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from service.models.response_cache import ENTRY_OVERHEAD, ResponseCache, key


class Seen:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []

    def looked_up(self, model: str, hit: bool) -> None:
        self.events.append(("hit" if hit else "miss", model, 0))

    def inserted(self, model: str, size: int) -> None:
        self.events.append(("insert", model, size))

    def evicted(self, model: str, size: int) -> None:
        self.events.append(("evict", model, size))


def test_keys_tell_apart_every_split_of_the_same_bytes() -> None:
    assert key([b"ab", b"c"]) != key([b"a", b"bc"]) != key([b"abc"])
    assert key(["m", 1, b"x"]) == key(["m", "1", b"x"])  # numbers as their text: the caller keeps types apart


def test_the_bound_holds_under_100_000_unique_answers() -> None:
    capacity = 1 << 20
    cache: ResponseCache[bytes] = ResponseCache(capacity)
    rng = np.random.default_rng(0)
    most = 0
    for i, size in enumerate(rng.integers(1, 4096, size=100_000)):
        cache.put(key([i]), b"", int(size), "m", "1")
        most = max(most, cache.held)
    assert most <= capacity and cache.held == cache.counts("m").bytes
    c = cache.counts("m")
    assert c.insertions == 100_000 and c.insertions - c.evictions == c.entries
    cache.put(key(["huge"]), b"", capacity, "m", "1")  # larger than the bound with its overhead: not kept
    assert cache.get(key(["huge"]), "m") is None


def test_least_recently_used_goes_first() -> None:
    seen = Seen()
    cache: ResponseCache[str] = ResponseCache(3 * (100 + ENTRY_OVERHEAD), seen)
    for name in "abc":
        cache.put(key([name]), name, 100, "m", "1")
    assert cache.get(key(["a"]), "m") == "a"  # a is now the most recent
    cache.put(key(["d"]), "d", 100, "m", "1")  # b goes
    assert [cache.get(key([n]), "m") for n in "abcd"] == ["a", None, "c", "d"]
    assert ("evict", "m", 100 + ENTRY_OVERHEAD) in seen.events


def test_identical_requests_in_flight_are_computed_once_and_failures_are_not_kept() -> None:
    cache: ResponseCache[int] = ResponseCache(1 << 20)
    calls: list[int] = []

    async def run() -> None:
        gate = asyncio.Event()

        async def compute() -> int:
            calls.append(1)
            await gate.wait()
            return 42

        first = asyncio.ensure_future(cache.get_or_compute(key(["x"]), "m", "1", compute, lambda v: 8))
        others = [
            asyncio.ensure_future(cache.get_or_compute(key(["x"]), "m", "1", compute, lambda v: 8)) for _ in range(5)
        ]
        await asyncio.sleep(0)
        gate.set()
        assert await first == (42, False)
        assert [await o for o in others] == [(42, True)] * 5
        assert await cache.get_or_compute(key(["x"]), "m", "1", compute, lambda v: 8) == (42, True)

        async def failing() -> int:
            calls.append(2)
            raise ValueError("the model failed")

        for _ in range(2):
            with pytest.raises(ValueError):
                await cache.get_or_compute(key(["y"]), "m", "1", failing, lambda v: 8)

    asyncio.run(run())
    assert calls == [1, 2, 2]  # one computation for six requests; a failure is computed again
    c = cache.counts("m")
    assert (c.hits, c.misses, c.insertions) == (6, 3, 1)


def test_a_versions_entries_go_with_it() -> None:
    cache: ResponseCache[str] = ResponseCache(1 << 20)
    for version in ("1", "2"):
        for i in range(3):
            cache.put(key([version, i]), "v", 10, "m", version)
    cache.put(key(["other"]), "v", 10, "n", "1")
    assert cache.drop("m", "1") == 3
    assert cache.counts("m").entries == 3 and cache.counts("n").entries == 1
    assert cache.drop("m") == 3 and cache.held == 10 + ENTRY_OVERHEAD
