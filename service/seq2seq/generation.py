"""g2p's step model, its hypotheses, and its beam search over an encoder and a one-step decoder with a
key/value cache. (Greedy decoding runs in the decoding engine: service.decoding.words.)

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
time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from service.seq2seq.beams import BeamSearch as Beams
from service.seq2seq.graphs import Layers

__all__ = ["CACHE_GROWTH", "BeamSearch", "Hypothesis", "StepModel", "beam_search", "cache_capacity", "pad_ids"]


class StepModel(Protocol):
    def encode(self, input_ids: np.ndarray, attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, S) ids and mask -> cross_keys, cross_values (L, B, H, S, K)."""
        ...

    def step(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        cache_keys: Layers,
        cache_values: Layers,
        cache_mask: np.ndarray,
        cross_keys: Layers,
        cross_values: Layers,
        memory_mask: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """-> log_probs (B, V), new_keys, new_values (L, B, H, K), attention (B, S). The per-layer arrays
        come as one (L, ...) array or as a list of each layer's (the decoding engine keeps them apart)."""
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


def _gather_rows(a: np.ndarray, index: np.ndarray, rows: int, width: int | None = None) -> np.ndarray:
    """(L, B, H, W, K) -> (L, rows, H, width, K): rows `index` of `a`, then zeros; every row zero-padded
    along axis 3. One allocation, each value copied once."""
    layers, _, heads, w, d_k = a.shape
    out = np.zeros((layers, rows, heads, w if width is None else width, d_k), dtype=a.dtype)
    np.take(a, index, axis=1, out=out[:, : len(index), :, :w], mode="clip")  # clip: no bounds-check buffer
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
    tag: Any = None  # the caller's handle (a request, an index), opaque to decoding
    with_attention: bool = False  # keep this row's cross-attention (the batch may keep everyone's)

    @property
    def output(self) -> list[int]:
        """Output tokens without <s> and </s>."""
        body = self.tokens[1:]
        return body[:-1] if self.done and body and body[-1] == self.eos else body

    eos: int = 2


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
    """Beam search for every source at once: words x beams rows in one batch (see `BeamSearch`);
    `on_word(index, best)` hears of each word as soon as it is done."""
    search = BeamSearch(model, sources, beam_size, max_len, bos_id, eos_id, with_attention)
    while len(search):
        for w, best in search.step():
            if on_word is not None:
                on_word(w, best)
    return search.results()


class BeamSearch:
    """A beam search over several words, advanced one step at a time: words x beams rows.

    Each word's beams are chosen by the generation engine's search (beams.py, transformers' rule: the 2k best
    continuations, the k best that do not end run on, hypotheses ranked by log-probability per token, a word
    done once k of them are finished: early_stopping true). This class is the adapter over g2p's graphs: the
    rows' caches, gathered by the chosen parents, and their attention. A word's rows leave the batch once it is
    done, and `step` returns it then, so that others' longer words hold up neither its answer nor the batch's
    cost. Stepping it a step at a time lets a scheduler interleave its steps with other work on the same model.
    """

    def __init__(
        self,
        model: StepModel,
        sources: Sequence[Sequence[int]],
        beam_size: int,
        max_len: int,
        bos_id: int = 1,
        eos_id: int = 2,
        with_attention: bool = False,
    ) -> None:
        n, k = len(sources), beam_size
        self.model, self.sources, self.k, self.max_len = model, sources, k, max_len
        self.bos_id, self.eos_id, self.with_attention = bos_id, eos_id, with_attention
        ids, mask = pad_ids(sources)
        ck, cv = model.encode(ids, mask)
        rows = np.repeat(np.arange(n), k)  # row r decodes word alive[r // k]
        self.ck, self.cv, self.memory_mask = ck[:, rows], cv[:, rows], mask[rows]
        layers, _, heads, _, d_k = ck.shape
        self.cache_k = np.zeros((layers, n * k, heads, cache_capacity(1), d_k), dtype=ck.dtype)
        self.cache_v = self.cache_k.copy()
        self.tokens = np.full((n * k, 1), bos_id, dtype=np.int64)
        # a word's search: max_len output tokens, then one more that ends it (</s> or not)
        self.searches = [Beams(k, frozenset({eos_id}), max_len + 1, 1.0, True) for _ in range(n)]
        self.attention = np.zeros((n * k, 0, ids.shape[1]), dtype=np.float32)
        self.histories: list[dict[tuple[int, ...], np.ndarray]] = [{} for _ in range(n)]  # finished ones' rows
        self.out: list[Hypothesis | None] = [None] * n
        self.alive = list(range(n))  # the words still searching, in row order
        self.t = 0  # the next step's position

    def __len__(self) -> int:
        """Rows the next step computes: words still searching x beams; 0 once every word is done."""
        return len(self.alive) * self.k

    def results(self) -> list[Hypothesis]:
        """The best hypothesis of each word done so far, in source order."""
        return [h for h in self.out if h is not None]

    def step(self) -> list[tuple[int, Hypothesis]]:
        """Advance every live beam by one token; return the words done at this step, with their best."""
        t, k, alive, tokens = self.t, self.k, self.alive, self.tokens
        # The caches are used through self only: an old one is freed as soon as its copy replaces it.
        cache_mask = np.zeros((len(tokens), self.cache_k.shape[3]), dtype=np.int64)
        cache_mask[:, :t] = 1
        positions = np.full(len(tokens), t, dtype=np.int64)
        log_probs, new_k, new_v, attn = self.model.step(
            tokens[:, -1], positions, self.cache_k, self.cache_v, cache_mask, self.ck, self.cv, self.memory_mask
        )
        self.cache_k[:, :, :, t], self.cache_v[:, :, :, t] = new_k, new_v
        new_rows, new_tokens, staying = [], [], []
        done: list[tuple[int, Hypothesis]] = []
        for a, w in enumerate(alive):
            search, first = self.searches[w], a * k
            for r in range(1 if t == 0 else k):  # at the first step a word's k rows are one
                search.offer(r, log_probs[first + r])
            choices = search.step()
            if self.with_attention:
                self._keep_histories(w, first, attn)
            if search.done:  # this word is done: its rows leave
                best = self.out[w] = self._best(w)
                done.append((w, best))
                continue
            staying.append(w)
            for parent, token in choices:
                new_rows.append(first + parent)
                new_tokens.append(token)
        self.t, self.alive = t + 1, staying
        if not staying:
            return done
        idx = np.asarray(new_rows)
        self.tokens = np.concatenate([tokens[idx], np.asarray(new_tokens)[:, None]], axis=1)
        # the surviving beams' caches, in one copy each, with room for the next slot
        self.cache_k = _gather_rows(self.cache_k[:, :, :, : t + 1], idx, len(idx), cache_capacity(t + 2))
        self.cache_v = _gather_rows(self.cache_v[:, :, :, : t + 1], idx, len(idx), cache_capacity(t + 2))
        self.attention = np.concatenate([self.attention[idx], attn[idx][:, None]], axis=1)
        if len(staying) < len(alive):  # a word's beams share its memory: gather only when words left
            self.ck, self.cv, self.memory_mask = self.ck[:, idx], self.cv[:, idx], self.memory_mask[idx]
        return done

    def _keep_histories(self, w: int, first: int, attn: np.ndarray) -> None:
        """The attention rows of word w's hypotheses that finished at this step: their parent row's, then
        this step's (a parent is the row whose tokens the hypothesis continues)."""
        for h in self.searches[w].best(self.k):
            if h.finished and h.tokens not in self.histories[w]:
                rows = range(first, first + (1 if self.t == 0 else self.k))
                parent = next(r for r in rows if tuple(self.tokens[r, 1:].tolist()) == h.tokens[:-1])
                self.histories[w][h.tokens] = np.concatenate([self.attention[parent], attn[parent][None]], axis=0)

    def _best(self, w: int) -> Hypothesis:
        """Word w's best finished hypothesis: <s>, its tokens, </s>."""
        best = self.searches[w].best()[0]
        seq = list(best.tokens[:-1] if best.tokens[-1:] == (self.eos_id,) else best.tokens)
        source = self.sources[w]
        h = Hypothesis(list(source), self.max_len, tokens=[self.bos_id, *seq, self.eos_id], score=best.score,
                       done=True, tag=w)  # fmt: skip
        h.eos = self.eos_id
        if self.with_attention:
            h.attention = [row[: len(source)] for row in self.histories[w][best.tokens][: len(seq) + 1]]
        return h
