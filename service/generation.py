"""Autoregressive decoding over an encoder and a one-step decoder with a key/value cache.

Pure numpy, so one implementation serves the PyTorch checkpoint (training, evaluation) and the
ONNX graphs (evaluation, serving). The model is anything with `encode` and `step` (see
`StepModel`); the arrays follow the exported graphs:

    cross_keys, cross_values   (L, B, H, S, K)  per decoder layer, computed once per word
    past_keys, past_values     (L, B, H, T, K)  self-attention cache, grows by one per step
    self_mask                  (B, T + 1)       1 where a cache slot (or the new token) is real
    memory_mask                (B, S)           1 where a grapheme is real

`DecodingBatch` is the unit of continuous batching: rows may join at any step (their cache is
padded to the batch's length and masked) and leave as soon as they finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["DecodingBatch", "Hypothesis", "StepModel", "beam_search", "greedy_decode"]


class StepModel(Protocol):
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, S) ids and mask -> cross_keys, cross_values (L, B, H, S, K)."""
        ...

    def step(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        past_keys: np.ndarray,
        past_values: np.ndarray,
        self_mask: np.ndarray,
        cross_keys: np.ndarray,
        cross_values: np.ndarray,
        memory_mask: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> log_probs (B, V), present_keys, present_values (L, B, H, T + 1, K), attention (B, S)."""
        ...


def pad_ids(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, S) ids and their 0/1 mask."""
    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), dtype=np.int64)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = r
    return ids, (ids != 0).astype(np.int64)


def _pad_axis(a: np.ndarray, axis: int, size: int, left: bool = False) -> np.ndarray:
    missing = size - a.shape[axis]
    if missing <= 0:
        return a
    widths = [(0, 0)] * a.ndim
    widths[axis] = (missing, 0) if left else (0, missing)
    return np.pad(a, widths)


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
        self.past_keys: np.ndarray | None = None
        self.past_values: np.ndarray | None = None
        self.cache_mask = np.zeros((0, 0), dtype=np.int64)  # (B, T)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def cache_length(self) -> int:
        return self.cache_mask.shape[1]

    def add(self, hyps: Sequence[Hypothesis]) -> None:
        """Encode the new rows together and merge them into the running batch."""
        if not hyps:
            return
        ids, mask = pad_ids([h.src for h in hyps])
        ck, cv = self.model.encode(ids, mask)
        n = len(hyps)
        for h in hyps:
            h.tokens, h.eos = [self.bos_id], self.eos_id
        if self.cross_keys is None or self.past_keys is None or self.past_values is None or not self.rows:
            layers, _, heads, _, d_k = ck.shape
            self.cross_keys, self.cross_values, self.memory_mask = ck, cv, mask
            self.past_keys = np.zeros((layers, n, heads, 0, d_k), dtype=ck.dtype)
            self.past_values = self.past_keys.copy()
            self.cache_mask = np.zeros((n, 0), dtype=np.int64)
            self.rows = list(hyps)
            return
        assert self.cross_values is not None
        s = max(self.memory_mask.shape[1], mask.shape[1])
        self.cross_keys = np.concatenate([_pad_axis(self.cross_keys, 3, s), _pad_axis(ck, 3, s)], axis=1)
        self.cross_values = np.concatenate([_pad_axis(self.cross_values, 3, s), _pad_axis(cv, 3, s)], axis=1)
        self.memory_mask = np.concatenate([_pad_axis(self.memory_mask, 1, s), _pad_axis(mask, 1, s)], axis=0)
        # New rows have no history: their cache is all padding, masked out, up to the batch's length.
        layers, _, heads, t, d_k = self.past_keys.shape
        empty = np.zeros((layers, n, heads, t, d_k), dtype=self.past_keys.dtype)
        self.past_keys = np.concatenate([self.past_keys, empty], axis=1)
        self.past_values = np.concatenate([self.past_values, empty], axis=1)
        self.cache_mask = np.concatenate([self.cache_mask, np.zeros((n, t), dtype=np.int64)], axis=0)
        self.rows.extend(hyps)

    def step(self) -> list[Hypothesis]:
        """Advance every row by one token; return the rows that finished (and leave the batch)."""
        assert self.past_keys is not None and self.past_values is not None
        assert self.cross_keys is not None and self.cross_values is not None
        tokens = np.array([h.tokens[-1] for h in self.rows], dtype=np.int64)
        positions = np.array([len(h.tokens) - 1 for h in self.rows], dtype=np.int64)
        self_mask = np.concatenate([self.cache_mask, np.ones((len(self.rows), 1), dtype=np.int64)], axis=1)
        log_probs, self.past_keys, self.past_values, attention = self.model.step(
            tokens,
            positions,
            self.past_keys,
            self.past_values,
            self_mask,
            self.cross_keys,
            self.cross_values,
            self.memory_mask,
        )
        self.cache_mask = self_mask
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
            self._keep(keep)
        return finished

    def _keep(self, index: list[int]) -> None:
        """Drop finished rows, then trim cache and memory columns no remaining row uses."""
        assert self.past_keys is not None and self.past_values is not None
        assert self.cross_keys is not None and self.cross_values is not None
        self.rows = [self.rows[i] for i in index]
        idx = np.asarray(index, dtype=np.int64)
        self.cache_mask = self.cache_mask[idx]
        self.memory_mask = self.memory_mask[idx]
        used = np.flatnonzero(self.cache_mask.any(axis=0))
        first = int(used[0]) if used.size else self.cache_mask.shape[1]
        s = max((len(h.src) for h in self.rows), default=0)
        self.cache_mask = self.cache_mask[:, first:]
        self.memory_mask = self.memory_mask[:, :s]
        self.past_keys = self.past_keys[:, idx, :, first:]
        self.past_values = self.past_values[:, idx, :, first:]
        self.cross_keys = self.cross_keys[:, idx, :, :s]
        self.cross_values = self.cross_values[:, idx, :, :s]


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
) -> list[Hypothesis]:
    """Beam search for every source at once: words x beams rows in one batch.

    Finished hypotheses are ranked by log-probability per token (length-normalised).
    """
    n, k = len(sources), beam_size
    ids, mask = pad_ids(sources)
    ck, cv = model.encode(ids, mask)
    rows = np.repeat(np.arange(n), k)  # row r decodes word r // k
    ck, cv, memory_mask = ck[:, rows], cv[:, rows], mask[rows]
    layers, _, heads, _, d_k = ck.shape
    past_k = np.zeros((layers, n * k, heads, 0, d_k), dtype=ck.dtype)
    past_v = past_k.copy()
    tokens = np.full((n * k, 1), bos_id, dtype=np.int64)
    scores = np.tile(np.r_[0.0, np.full(k - 1, -np.inf)], n)  # only beam 0 is alive at first
    attention = np.zeros((n * k, 0, ids.shape[1]), dtype=np.float32)
    finished: list[list[tuple[float, list[int], np.ndarray]]] = [[] for _ in range(n)]
    for t in range(max_len + 1):
        self_mask = np.ones((n * k, t + 1), dtype=np.int64)
        positions = np.full(n * k, t, dtype=np.int64)
        log_probs, past_k, past_v, attn = model.step(
            tokens[:, -1], positions, past_k, past_v, self_mask, ck, cv, memory_mask
        )
        vocab = log_probs.shape[1]
        total = (scores[:, None] + log_probs).reshape(n, k * vocab)  # (words, beams x V)
        top = np.argsort(-total, axis=1)[:, : 2 * k]
        new_rows, new_tokens, new_scores = [], [], []
        for w in range(n):
            kept = 0
            for flat in top[w]:
                score = float(total[w, flat])
                parent, token = w * k + flat // vocab, int(flat % vocab)
                if not np.isfinite(score):
                    break
                if token == eos_id or t == max_len:
                    hist = np.concatenate([attention[parent], attn[parent][None]], axis=0)
                    seq = [*tokens[parent, 1:].tolist(), *([token] if token != eos_id else [])]
                    if len(finished[w]) < k:
                        finished[w].append((score / (t + 1), seq, hist))
                    continue
                new_rows.append(parent)
                new_tokens.append(token)
                new_scores.append(score)
                kept += 1
                if kept == k:
                    break
            while kept < k:  # keep the row count fixed: dead beams score -inf
                new_rows.append(w * k)
                new_tokens.append(eos_id)
                new_scores.append(-np.inf)
                kept += 1
        if all(len(f) >= k for f in finished) or t == max_len:
            break
        idx = np.asarray(new_rows)
        tokens = np.concatenate([tokens[idx], np.asarray(new_tokens)[:, None]], axis=1)
        scores = np.asarray(new_scores)
        past_k, past_v = past_k[:, idx], past_v[:, idx]
        attention = np.concatenate([attention[idx], attn[idx][:, None]], axis=1)
    out = []
    for w in range(n):
        best_score, seq, hist = max(finished[w], key=lambda f: f[0])
        h = Hypothesis(list(sources[w]), max_len, tokens=[bos_id, *seq, eos_id], score=best_score, done=True, tag=w)
        h.eos = eos_id
        if with_attention:
            h.attention = [row[: len(sources[w])] for row in hist[: len(seq) + 1]]
        out.append(h)
    return out
