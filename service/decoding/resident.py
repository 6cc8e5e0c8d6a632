"""The running rows' caches kept in place from step to step, for a decoder that grows its cache in place.

A decoder that takes past arrays with room (`StartsFromEncoder.room`, g2p's) writes each step's keys and
values into the first free position of the buffers it is given. Its rows' caches then stay in the engine's
buffers, one row each, from step to step: a row that leaves is filled by the last row (that row's data
moved, nobody else's), a row that joins is written into the next free row, and only growing a buffer, or
dropping leading positions no row uses any more, copies the batch. (Restacking every cache at every step
that a row joins or leaves, as a decoder whose graph gives fresh present arrays needs, cost g2p's words a
third more time than its decoding.)

    self-attention buffers  (R, H, C, D)  R rows of room, C positions of room, the first T used
    cross-attention arrays  (R, H, W, D)  a row's fixed once it joins; W the longest prompt so far
    encoder mask (R, W), cache mask (R, C)

A row's cache is its last `length` positions before T; the positions before them are masked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from service.decoding.steps import CacheLayout

__all__ = ["Held", "ResidentCaches"]


class Held(Protocol):
    """What a row is to the buffers: the engine's sequence, its prompt and its cache until it joins."""

    cache: list[np.ndarray]

    @property
    def prompt(self) -> tuple[int, ...]: ...
    @property
    def length(self) -> int: ...


R = TypeVar("R", bound=Held)


class ResidentCaches(Generic[R]):
    """The caches of the rows a decoding call runs, kept in buffers across steps."""

    def __init__(self, layout: CacheLayout, dtype: type[np.floating[Any]], room: int) -> None:
        self.own, self.heads, self.head_dim = layout.self_attention, layout.heads, layout.head_dim
        self.dtype, self.room = dtype, max(1, room)
        self.rows: list[R] = []
        self.lengths: list[int] = []  # each row's cache positions, the last ones before T
        self.arrays: list[np.ndarray] = []  # one a past input: a buffer (self-attention) or fixed (cross)
        self.mask = np.zeros((0, 0), dtype=np.int64)  # (R, W): 1 where a prompt token is real
        self.cache_mask = np.zeros((0, 0), dtype=np.int64)  # (R, C): 1 where a cache position is real
        self.t = 0  # positions used: the next step writes position T

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)

    def hold(self, rows: Sequence[R]) -> None:
        """Before a step: the buffers hold exactly `rows` (those no longer there leave, the new ones join with
        their caches so far, which they then stop holding), with a free position for the step."""
        wanted = {id(s) for s in rows}
        self._leave([i for i, s in enumerate(self.rows) if id(s) not in wanted])
        held = {id(s) for s in self.rows}
        joining = [s for s in rows if id(s) not in held]
        if joining:
            self._join(joining)
        self._make_room()

    def past(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """The call's encoder mask (B, W), self-attention mask (B, T+1: the cache's, then the new token's) and
        past: the buffers' first B rows and T positions, views the decoder grows in place."""
        n, t = len(self.rows), self.t
        self_mask = np.ones((n, t + 1), dtype=np.int64)
        self_mask[:, :t] = self.cache_mask[:n, :t]
        past = [a[:n, :, :t] if own else a[:n] for a, own in zip(self.arrays, self.own, strict=True)]
        return self.mask[:n], self_mask, past

    def stepped(self) -> None:
        """After a step: the decoder wrote position T of every row."""
        self.cache_mask[: len(self.rows), self.t] = 1
        self.t += 1
        self.lengths = [n + 1 for n in self.lengths]

    def _leave(self, rows: list[int]) -> None:
        for i in sorted(rows, reverse=True):
            last = len(self.rows) - 1
            if i != last:
                for a in (*self.arrays, self.mask, self.cache_mask):
                    a[i] = a[last]
                self.rows[i], self.lengths[i] = self.rows[last], self.lengths[last]
            self.rows.pop()
            self.lengths.pop()
        if not self.rows:
            self.t = 0

    def _join(self, new: list[R]) -> None:
        n, k = len(self.rows), len(new)
        lengths = [s.length for s in new]
        t = max(self.t, *lengths)  # a joiner's cache ends at T, as every row's does
        width = max(len(s.prompt) for s in new)
        capacity_rows = self.mask.shape[0]
        if not n or n + k > capacity_rows or width > self.mask.shape[1] or t > self.t:
            self._grow(max(n + k, 2 * n), max(width, self.mask.shape[1] if n else 0), t)
        for a in (*self.arrays, self.mask, self.cache_mask):
            a[n : n + k] = 0  # rows that left may have been there
        for j, (s, m) in enumerate(zip(new, lengths, strict=True)):
            r, w = n + j, len(s.prompt)
            for a, c, own in zip(self.arrays, s.cache, self.own, strict=True):
                if not own:
                    a[r, :, :w] = c
                elif m:
                    a[r, :, t - m : t] = c
            self.mask[r, :w] = 1
            self.cache_mask[r, t - m : t] = 1
            s.cache = []  # held here from now on
        self.rows += new
        self.lengths += lengths

    def _grow(self, rows: int, width: int, t: int) -> None:
        """Arrays for `rows` rows and `width` prompt positions, with T = `t` (the held rows' positions moved
        right by t - T) and room after it; the held rows copied in."""
        n, shift, capacity = len(self.rows), t - self.t, t + self.room
        h, d = self.heads, self.head_dim
        arrays = [np.zeros((rows, h, capacity if own else width, d), dtype=self.dtype) for own in self.own]
        mask = np.zeros((rows, width), dtype=np.int64)
        cache_mask = np.zeros((rows, capacity), dtype=np.int64)
        if n:
            for a, old, own in zip(arrays, self.arrays, self.own, strict=True):
                if own:
                    a[:n, :, shift:t] = old[:n, :, : self.t]
                else:
                    a[:n, :, : old.shape[2]] = old[:n]
            mask[:n, : self.mask.shape[1]] = self.mask[:n]
            cache_mask[:n, shift:t] = self.cache_mask[:n, : self.t]
        self.arrays, self.mask, self.cache_mask, self.t = arrays, mask, cache_mask, t

    def _make_room(self) -> None:
        """When position T is past the buffers, or `room` leading positions are used by no row any more:
        the used positions copied into buffers with `room` free after them."""
        if not self.rows:
            return
        t, capacity = self.t, self.cache_mask.shape[1]
        first = t - max(self.lengths)  # positions before it: no row's
        if t < capacity and first < self.room:
            return
        used, rows = t - first, self.cache_mask.shape[0]
        arrays = []
        for a, own in zip(self.arrays, self.own, strict=True):
            if own:
                b = np.zeros((rows, a.shape[1], used + self.room, a.shape[3]), dtype=self.dtype)
                b[:, :, :used] = a[:, :, first:t]
                a = b
            arrays.append(a)
        cache_mask = np.zeros((rows, used + self.room), dtype=np.int64)
        cache_mask[:, :used] = self.cache_mask[:, first:t]
        self.arrays, self.cache_mask, self.t = arrays, cache_mask, used
