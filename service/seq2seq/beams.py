"""Beam search for one request, step by step, as transformers' `generate(num_beams=N, do_sample=False)` runs it
(GenerationMixin._beam_search, transformers 4.57), in numpy and knowing nothing of the model or the engine.

The engine runs the search's running beams as rows of its batch and hands their next-token log-probabilities
to `step`; the search answers, for each beam of the next step, the row whose cache it continues and the token
it adds (the engine reorders the caches by these parents). A step:

1. every running beam's log-probs plus the beam's score; the K = max(2, 1 + eos ids) x N best continuations
   over all beams (K, not N, so that N of them remain when some end);
2. a continuation ends (it "hits") on an end-of-sequence id or at max_tokens;
3. the N best that do not end run on;
4. those among the first N that end are finished hypotheses, scored log-prob / length ** length_penalty, and
   the N best finished are kept;
5. the search stops when every continuation ends, when the best running beam cannot beat the worst finished
   one (early stopping's heuristic, the length of now or, with early_stopping "never" and a positive length
   penalty, of max_tokens), or, with early_stopping true, once N hypotheses are finished.

The first step has one row (the prompt's): transformers gives beams 1..N-1 a score of -1e9 there, so only
beam 0's continuations can be chosen, and its N-1 copies need not run. Scores are float32 and the "ruled
out" offset -1e9, as transformers', so that the choices are its choices.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

__all__ = ["BeamSearch", "EarlyStopping", "Hypothesis", "log_softmax"]

EarlyStopping = bool | Literal["never"]  # when a search stops, as transformers' early_stopping

RULED_OUT = np.float32(-1.0e9)  # transformers' score for a beam that must not be chosen


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(V,) logits -> float32 log-probabilities."""
    x = logits.astype(np.float32, copy=False)
    shifted = x - x.max()
    return shifted - np.log(np.exp(shifted).sum(dtype=np.float32))  # type: ignore[no-any-return]


@dataclass(frozen=True)
class Hypothesis:
    tokens: tuple[int, ...]  # the output tokens, the end-of-sequence id included when it ended on one
    score: float  # log-probability / length ** length_penalty; RULED_OUT for an empty slot
    finished: bool


@dataclass
class BeamSearch:
    """One request's search: its running beams' tokens and scores, and the best N finished hypotheses."""

    num_beams: int
    eos: frozenset[int]  # ids that end a hypothesis (the model's EOS and the request's stop token ids)
    max_tokens: int  # output tokens at most, the end-of-sequence id included
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    running: list[tuple[int, ...]] = field(default_factory=lambda: [()])  # each running beam's tokens
    scores: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.float32))  # (rows,) their log-probs
    done: bool = False
    _finished: list[Hypothesis] = field(default_factory=list)
    _improvable: bool = True  # early stopping's heuristic: the running beams may still beat the finished ones
    _offered: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._finished = [Hypothesis((), float(RULED_OUT), False)] * self.num_beams

    @property
    def keep(self) -> int:
        """K: continuations taken at each step."""
        return max(2, 1 + len(self.eos)) * self.num_beams

    def offer(self, row: int, log_probs: np.ndarray) -> bool:
        """Running beam `row`'s (V,) log-probs for its next token (after any logits processor); whether every
        running beam's are in (then `step` may run)."""
        self._offered[row] = log_probs
        return len(self._offered) == len(self.running)

    def step(self) -> list[tuple[int, int]]:
        """One step over the offered log-probs: for each running beam of the next step, (its parent row, the
        token it adds). Empty once the search is done."""
        rows = [self._offered.pop(r) for r in range(len(self.running))]
        vocab = len(rows[0])
        total = (np.stack(rows).astype(np.float32) + self.scores[:, None]).reshape(-1)  # (rows x V,)
        k = min(self.keep, len(total))
        top = np.argpartition(-total, k - 1)[:k]
        top = top[np.argsort(-total[top], kind="stable")]  # descending, as torch.topk
        top_scores = total[top]
        parents, tokens = top // vocab, top % vocab
        length = len(self.running[0]) + 1  # output tokens of each continuation
        candidates = [(*self.running[int(p)], int(t)) for p, t in zip(parents, tokens, strict=True)]
        hits = np.array([t in self.eos or length >= self.max_tokens for t in tokens.tolist()])
        # 3. the N best that run on
        running_scores = top_scores + hits.astype(np.float32) * RULED_OUT
        order = np.argsort(-running_scores, kind="stable")[: self.num_beams]
        self.running = [candidates[i] for i in order]
        self.scores = running_scores[order]
        # 4. the finished: only the first N of the K may be, and only while they may still improve the answer
        full = all(h.finished for h in self._finished) and self.early_stopping is True
        merged = list(self._finished)
        penalty = np.float32(length**self.length_penalty)
        for i, (tokens_i, score) in enumerate(zip(candidates, top_scores, strict=True)):
            ended = bool(hits[i]) and i < self.num_beams
            scored = np.float32(score) / penalty
            scored += RULED_OUT * (full + (not self._improvable) + (not ended))
            merged.append(Hypothesis(tokens_i, float(np.float32(scored)), ended))
        best = np.argsort(-np.array([h.score for h in merged], dtype=np.float32), kind="stable")[: self.num_beams]
        self._finished = [merged[i] for i in best]
        # 5. whether to go on
        self._improvable = self._improvable and self._may_improve(length)
        complete = all(h.finished for h in self._finished) and self.early_stopping is True
        if not self._improvable or complete or bool(hits.all()):
            self.done = True
            return []
        return [(int(parents[i]), int(tokens[i])) for i in order]

    def _may_improve(self, length: int) -> bool:
        """Whether the best running beam, at its best possible length, beats the worst finished hypothesis."""
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            length = self.max_tokens
        best = np.float32(self.scores[0]) / np.float32(length**self.length_penalty)
        worst = min(np.float32(h.score) for h in self._finished)
        return any(best > (worst if h.finished else RULED_OUT) for h in self._finished)

    def best(self, n: int = 1) -> list[Hypothesis]:
        """The n best finished hypotheses, best first."""
        return self._finished[:n]
