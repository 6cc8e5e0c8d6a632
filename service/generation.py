"""Autoregressive decoding over an encoder and a one-step decoder with a key/value cache.

Pure numpy, so one implementation serves the PyTorch checkpoint (training, evaluation) and the
ONNX graphs (evaluation, serving). The model is anything with `encode` and `step` (see
`StepModel`); the arrays follow the exported graphs:

    cross_keys, cross_values   (L, B, H, S, K)  per decoder layer, computed once per word
    cache_keys, cache_values   (L, B, H, C, K)  self-attention cache: C slots, the first T used
    cache_mask                 (B, C)           1 where a cache slot is real
    memory_mask                (B, S)           1 where a grapheme is real
    new_keys, new_values       (L, B, H, K)     a step's own keys and values, for slot T

The cache is the caller's and is never copied by a step: the step reads it in place and the
caller writes the new keys and values into the next free slot, growing the cache a few slots at a
time. `DecodingBatch` is the unit of continuous batching: rows may join at any step (their cache
is padded to the batch's length and masked) and leave as soon as they finish.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["CACHE_GROWTH", "DecodingBatch", "Hypothesis", "StepModel", "beam_search", "cache_capacity", "greedy_decode"]


class StepModel(Protocol):
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, S) ids and mask -> cross_keys, cross_values (L, B, H, S, K)."""
        ...

    def step(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        cache_keys: np.ndarray,
        cache_values: np.ndarray,
        cache_mask: np.ndarray,
        cross_keys: np.ndarray,
        cross_values: np.ndarray,
        memory_mask: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> log_probs (B, V), new_keys, new_values (L, B, H, K), attention (B, S)."""
        ...


CACHE_GROWTH = 8  # slots a cache grows by: one copy every 8 steps, at most 7 masked slots attended


def cache_capacity(slots: int) -> int:
    """Slots to allocate for a cache that must hold `slots`: the next multiple of CACHE_GROWTH."""
    return -(-slots // CACHE_GROWTH) * CACHE_GROWTH


def pad_ids(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, S) ids and their 0/1 mask."""
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, (ids != 0).astype(np.int64)


def _gather_rows(
    a: np.ndarray, index: np.ndarray, rows: int, width: int | None = None, new: np.ndarray | None = None
) -> np.ndarray:
    """(L, B, H, W, K) -> (L, rows, H, width, K): rows `index` of `a`, then the rows of `new`, then
    zeros; every row zero-padded along axis 3. One allocation, each value copied once."""
    layers, _, heads, w, d_k = a.shape
    out = np.zeros((layers, rows, heads, w if width is None else width, d_k), dtype=a.dtype)
    k = len(index)
    np.take(a, index, axis=1, out=out[:, :k, :, :w], mode="clip")  # clip: no bounds-check buffer
    if new is not None:
        out[:, k : k + new.shape[1], :, : new.shape[3]] = new
    return out


@dataclass
class Hypothesis:
    """One word being decoded: its graphemes, the tokens so far (from <s>), its attention rows."""

    src: list[int]
    max_len: int  # output tokens allowed, </s> excluded
    tokens: list[int] = field(default_factory=list)
    attention: list[np.ndarray] = field(default_factory=list)  # one (S,) row per output token
    score: float = 0.0
    done: bool = False
    tag: object = None  # the caller's handle (a request, an index)
    with_attention: bool = False  # keep this row's cross-attention (the batch may keep everyone's)

    @property
    def output(self) -> list[int]:
        """Output tokens without <s> and </s>."""
        body = self.tokens[1:]
        return body[:-1] if self.done and body and body[-1] == self.eos else body

    eos: int = 2


class DecodingBatch:
    """Rows decoded in lock step; rows join between steps and leave as they finish."""

    def __init__(self, model: StepModel, bos_id: int = 1, eos_id: int = 2, with_attention: bool = False) -> None:
        self.model = model
        self.bos_id, self.eos_id = bos_id, eos_id
        self.with_attention = with_attention
        self.rows: list[Hypothesis] = []
        self.cross_keys: np.ndarray | None = None
        self.cross_values: np.ndarray | None = None
        self.memory_mask = np.zeros((0, 0), dtype=np.int64)
        self.cache_keys: np.ndarray | None = None
        self.cache_values: np.ndarray | None = None
        self.cache_mask = np.zeros((0, 0), dtype=np.int64)  # (B, C)
        self.cache_length = 0  # slots used, T <= C: the next step writes slot T
        self._staying: list[int] | None = None  # after a step where rows finished: the rows that stay

    def __len__(self) -> int:
        return len(self.rows) if self._staying is None else len(self._staying)

    def add(self, hyps: Sequence[Hypothesis]) -> None:
        """Encode the new rows together and merge them into the running batch.

        Rows that finished at the last step leave here too: the arrays are rebuilt once, the
        rows that stay copied in and the new rows written after them, instead of a copy to
        drop the finished rows and another to append the new ones.
        """
        if not hyps:
            self._rebuild()
            return
        ids, mask = pad_ids([h.src for h in hyps])
        ck, cv = self.model.encode(ids, mask)
        for h in hyps:
            h.tokens, h.eos = [self.bos_id], self.eos_id
        self._rebuild(list(hyps), ck, cv, mask)

    def _rebuild(
        self,
        hyps: list[Hypothesis] | None = None,
        ck: np.ndarray | None = None,
        cv: np.ndarray | None = None,
        mask: np.ndarray | None = None,
    ) -> None:
        """Apply the rows that left at the last step (`_staying`) and append `hyps`, in one copy.

        The self-attention cache keeps only the slots some staying row uses (new rows have no
        history: theirs is padding, masked out); the memory keeps the longest staying source.
        """
        staying, self._staying = self._staying, None
        if staying is None and not hyps:
            return
        old = self.rows if staying is None else [self.rows[i] for i in staying]
        new = hyps or []
        if not old and not new:
            self.rows, self.cache_mask, self.memory_mask = [], self.cache_mask[:0, :0], self.memory_mask[:0, :0]
            self.cache_length = 0
            return
        if not old:  # a fresh batch: the encoder's arrays are the memory as they are
            assert ck is not None and cv is not None and mask is not None
            layers, n, heads, _, d_k = ck.shape
            self.cross_keys, self.cross_values, self.memory_mask = ck, cv, mask
            shape = (layers, n, heads, cache_capacity(1), d_k)
            self.cache_keys, self.cache_values = np.zeros(shape, ck.dtype), np.zeros(shape, ck.dtype)
            self.cache_mask = np.zeros((n, shape[3]), dtype=np.int64)
            self.cache_length = 0
            self.rows = new
            return
        assert self.cache_keys is not None and self.cache_values is not None
        assert self.cross_keys is not None and self.cross_values is not None
        idx = np.arange(len(self.rows)) if staying is None else np.asarray(staying, dtype=np.int64)
        cache_mask = self.cache_mask[idx, : self.cache_length]
        used = np.flatnonzero(cache_mask.any(axis=0))
        first = int(used[0]) if used.size else self.cache_length
        length = self.cache_length - first
        s_old = max(len(h.src) for h in old)
        s = max(s_old, mask.shape[1] if mask is not None else 0)
        k, rows = len(old), len(old) + len(new)
        capacity = cache_capacity(length + 1)
        self.cache_keys = _gather_rows(self.cache_keys[:, :, :, first : self.cache_length], idx, rows, capacity)
        self.cache_values = _gather_rows(self.cache_values[:, :, :, first : self.cache_length], idx, rows, capacity)
        self.cross_keys = _gather_rows(self.cross_keys[:, :, :, :s_old], idx, rows, s, ck)
        self.cross_values = _gather_rows(self.cross_values[:, :, :, :s_old], idx, rows, s, cv)
        self.cache_mask = np.zeros((rows, capacity), dtype=np.int64)
        self.cache_mask[:k, :length] = cache_mask[:, first:]
        self.cache_length = length
        memory_mask = np.zeros((rows, s), dtype=np.int64)
        memory_mask[:k, :s_old] = self.memory_mask[idx, :s_old]
        if mask is not None:
            memory_mask[k:, : mask.shape[1]] = mask
        self.memory_mask = memory_mask
        self.rows = old + new

    def _grow(self) -> None:
        """A full cache gets CACHE_GROWTH more slots (one copy)."""
        assert self.cache_keys is not None and self.cache_values is not None
        t, capacity = self.cache_length, cache_capacity(self.cache_length + 1)
        everyone = np.arange(len(self.rows))
        self.cache_keys = _gather_rows(self.cache_keys[:, :, :, :t], everyone, len(everyone), capacity)
        self.cache_values = _gather_rows(self.cache_values[:, :, :, :t], everyone, len(everyone), capacity)
        mask = np.zeros((len(self.rows), capacity), dtype=np.int64)
        mask[:, :t] = self.cache_mask[:, :t]
        self.cache_mask = mask

    def step(self) -> list[Hypothesis]:
        """Advance every row by one token; return the rows that finished (and leave the batch)."""
        self._rebuild()
        if self.cache_length == self.cache_mask.shape[1]:
            self._grow()
        assert self.cache_keys is not None and self.cache_values is not None
        assert self.cross_keys is not None and self.cross_values is not None
        tokens = np.array([h.tokens[-1] for h in self.rows], dtype=np.int64)
        positions = np.array([len(h.tokens) - 1 for h in self.rows], dtype=np.int64)
        log_probs, new_keys, new_values, attention = self.model.step(
            tokens,
            positions,
            self.cache_keys,
            self.cache_values,
            self.cache_mask,
            self.cross_keys,
            self.cross_values,
            self.memory_mask,
        )
        t = self.cache_length  # every row's new token takes slot t, in place
        self.cache_keys[:, :, :, t] = new_keys
        self.cache_values[:, :, :, t] = new_values
        self.cache_mask[:, t] = 1
        self.cache_length = t + 1
        best = log_probs.argmax(axis=-1)
        finished, keep = [], []
        for i, h in enumerate(self.rows):
            token = int(best[i])
            h.tokens.append(token)
            h.score += float(log_probs[i, token])
            if self.with_attention or h.with_attention:
                h.attention.append(attention[i, : len(h.src)].copy())
            if token == self.eos_id or len(h.tokens) - 1 >= h.max_len:
                h.done = token == self.eos_id
                finished.append(h)
            else:
                keep.append(i)
        if finished:
            self._staying = keep  # they leave at the next add or step: one copy with the rows joining
        return finished


def greedy_decode(
    model: StepModel,
    sources: Sequence[Sequence[int]],
    max_len: int,
    batch_size: int = 256,
    with_attention: bool = False,
) -> list[Hypothesis]:
    """Greedy decoding of every source, `batch_size` rows at a time, sorted by length."""
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[Hypothesis | None] = [None] * len(sources)
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        batch = DecodingBatch(model, with_attention=with_attention)
        batch.add([Hypothesis(list(sources[i]), max_len, tag=i) for i in chunk])
        while len(batch):
            for h in batch.step():
                results[h.tag] = h  # type: ignore[index]
    return [h for h in results if h is not None]


def beam_search(
    model: StepModel,
    sources: Sequence[Sequence[int]],
    beam_size: int,
    max_len: int,
    bos_id: int = 1,
    eos_id: int = 2,
    with_attention: bool = False,
    on_word: Callable[[int, Hypothesis], None] | None = None,
) -> list[Hypothesis]:
    """Beam search for every source at once: words x beams rows in one batch.

    Finished hypotheses are ranked by log-probability per token (length-normalised). A word's rows
    leave the batch once it has `beam_size` finished hypotheses, and `on_word(index, best)` hears
    of it then, so that others' longer words hold up neither its answer nor the batch's cost.
    """
    n, k = len(sources), beam_size
    ids, mask = pad_ids(sources)
    ck, cv = model.encode(ids, mask)
    rows = np.repeat(np.arange(n), k)  # row r decodes word alive[r // k]
    ck, cv, memory_mask = ck[:, rows], cv[:, rows], mask[rows]
    layers, _, heads, _, d_k = ck.shape
    cache_k = np.zeros((layers, n * k, heads, cache_capacity(1), d_k), dtype=ck.dtype)
    cache_v = cache_k.copy()
    tokens = np.full((n * k, 1), bos_id, dtype=np.int64)
    scores = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], n)  # only beam 0 is alive at first
    attention = np.zeros((n * k, 0, ids.shape[1]), dtype=np.float32)
    finished: list[list[tuple[float, list[int], np.ndarray]]] = [[] for _ in range(n)]
    out: list[Hypothesis | None] = [None] * n
    alive = list(range(n))  # the words still searching, in row order
    for t in range(max_len + 1):
        cache_mask = np.zeros((len(tokens), cache_k.shape[3]), dtype=np.int64)
        cache_mask[:, :t] = 1
        positions = np.full(len(tokens), t, dtype=np.int64)
        log_probs, new_k, new_v, attn = model.step(
            tokens[:, -1], positions, cache_k, cache_v, cache_mask, ck, cv, memory_mask
        )
        cache_k[:, :, :, t], cache_v[:, :, :, t] = new_k, new_v
        vocab = log_probs.shape[1]
        total = (scores[:, None] + log_probs).reshape(len(alive), k * vocab)  # (words, beams x V)
        top = np.argsort(-total, axis=1)[:, : 2 * k]
        new_rows, new_tokens, new_scores, staying = [], [], [], []
        for a, w in enumerate(alive):
            kept: list[tuple[int, int, float]] = []
            for flat in top[a]:
                score = float(total[a, flat])
                parent, token = a * k + flat // vocab, int(flat % vocab)
                if not np.isfinite(score):
                    break
                if token == eos_id or t == max_len:
                    hist = np.concatenate([attention[parent], attn[parent][None]], axis=0)
                    seq = [*tokens[parent, 1:].tolist(), *([token] if token != eos_id else [])]
                    if len(finished[w]) < k:
                        finished[w].append((score / (t + 1), seq, hist))
                    continue
                kept.append((parent, token, score))
                if len(kept) == k:
                    break
            if len(finished[w]) >= k or t == max_len:  # this word is done: its rows leave
                out[w] = _best(finished[w], sources[w], max_len, bos_id, eos_id, with_attention, tag=w)
                if on_word is not None:
                    on_word(w, out[w])
                continue
            kept += [(a * k, eos_id, -np.inf)] * (k - len(kept))  # keep k rows a word: dead beams score -inf
            staying.append(w)
            for parent, token, score in kept:
                new_rows.append(parent)
                new_tokens.append(token)
                new_scores.append(score)
        if not staying:
            break
        idx = np.asarray(new_rows)
        tokens = np.concatenate([tokens[idx], np.asarray(new_tokens)[:, None]], axis=1)
        scores = np.asarray(new_scores)
        # the surviving beams' caches, in one copy each, with room for the next slot
        cache_k = _gather_rows(cache_k[:, :, :, : t + 1], idx, len(idx), cache_capacity(t + 2))
        cache_v = _gather_rows(cache_v[:, :, :, : t + 1], idx, len(idx), cache_capacity(t + 2))
        attention = np.concatenate([attention[idx], attn[idx][:, None]], axis=1)
        if len(staying) < len(alive):  # a word's beams share its memory: gather only when words left
            ck, cv, memory_mask = ck[:, idx], cv[:, idx], memory_mask[idx]
        alive = staying
    return [h for h in out if h is not None]


def _best(
    finished: list[tuple[float, list[int], np.ndarray]],
    source: Sequence[int],
    max_len: int,
    bos_id: int,
    eos_id: int,
    with_attention: bool,
    tag: object,
) -> Hypothesis:
    best_score, seq, hist = max(finished, key=lambda f: f[0])
    h = Hypothesis(list(source), max_len, tokens=[bos_id, *seq, eos_id], score=best_score, done=True, tag=tag)
    h.eos = eos_id
    if with_attention:
        h.attention = [row[: len(source)] for row in hist[: len(seq) + 1]]
    return h
