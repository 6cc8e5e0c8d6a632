"""Choosing the next token from a row of logits, as transformers' generate does: the repetition penalty,
then greedy's argmax, or sampling after temperature, top-k and top-p (in that order, as its warpers run)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

__all__ = ["Chooser"]


class Chooser:
    """One sequence's choice of tokens: its settings and, when sampling, its own random stream."""

    __slots__ = ("penalty", "rng", "sample", "temperature", "top_k", "top_p")

    def __init__(self, sample: bool, temperature: float, top_k: int, top_p: float, penalty: float,
                 seed: int | None) -> None:  # fmt: skip
        self.sample, self.temperature, self.top_k, self.top_p, self.penalty = sample, temperature, top_k, top_p, penalty
        self.rng = np.random.default_rng(seed) if sample else None

    def scores(self, logits: np.ndarray, seen: Iterable[int]) -> np.ndarray:
        """The logits (V,) with the repetition penalty applied to the tokens `seen` (prompt and output)."""
        if self.penalty == 1.0:
            return logits
        logits = logits.astype(np.float32, copy=True)
        index = np.fromiter(set(seen), dtype=np.int64)
        if len(index):
            s = logits[index]
            logits[index] = np.where(s < 0, s * self.penalty, s / self.penalty)
        return logits

    def choose(self, logits: np.ndarray, seen: Iterable[int]) -> int:
        scores = self.scores(logits, seen)
        if self.rng is None:
            return int(np.argmax(scores))
        scores = scores.astype(np.float64) / self.temperature
        if 0 < self.top_k < len(scores):
            kth = np.partition(scores, -self.top_k)[-self.top_k]
            scores = np.where(scores < kth, -np.inf, scores)
        probs = np.exp(scores - scores.max())
        probs /= probs.sum()
        if self.top_p < 1.0:
            order = np.argsort(probs)  # ascending, as transformers' TopPLogitsWarper
            cumulative = np.cumsum(probs[order])
            drop = cumulative <= 1 - self.top_p
            drop[-1] = False  # the most likely token always stays
            probs[order[drop]] = 0.0
            probs /= probs.sum()
        return int(self.rng.choice(len(probs), p=probs))
