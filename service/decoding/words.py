"""g2p's graphs in the decoding engine: the adapter that lets its words decode as the engine's sequences.

g2p's encoder gives each layer's cross-attention keys and values, and its one-step decoder takes a cache
of C slots under a mask and gives the step's own keys and values (service.seq2seq.generation's
`StepModel`). `WordSteps` shows them to the engine as an encoder-decoder whose decoder also takes the first
step (`StartsFromEncoder`): a word's cache is its layers' self-attention keys and values (grown a slot a
step) and its cross-attention keys and values (fixed), in the engine's layout, (H, P, D) each. A word is a
`Sequence` whose prompt is its graphemes, decoded greedily from <s> until </s> or `max_len` phonemes.

`greedy_decode` decodes a list of words in batches (training's evaluation, the export's checks, warm-up);
the g2p kind's scheduler joins words into a running engine as requests come (service.scheduling.continuous).
"""

from __future__ import annotations

from collections.abc import Sequence as Words
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from service.decoding.choosing import Chooser
from service.decoding.engine import Engine, Message, Sequence
from service.decoding.request import GenerationRequest
from service.decoding.steps import CacheLayout
from service.errors import ServingError
from service.priority import ComputeThreads
from service.seq2seq.generation import Hypothesis, StepModel

__all__ = ["BOS", "EOS", "Outcome", "WordSteps", "error_of", "greedy_decode", "hypothesis", "word", "word_engine"]

BOS, EOS = 1, 2  # g2p's <s> and </s> (service.seq2seq.vocab's specials)
_PER_LAYER = ("cache_keys", "cache_values", "cross_keys", "cross_values")  # the decoder's inputs, each layer
ROOM = 8  # positions a word's cache grows by in place: the step's keys are written there, a copy every 8 steps
_GREEDY = Chooser(False, 1.0, 0, 1.0, 1.0, None)  # holds no state when it does not sample: shared


class WordSteps:
    """A g2p `StepModel` as the engine's encoder-decoder graphs (see the module's docstring)."""

    masked = True  # the decoder takes a cache mask: rows of different lengths run in one call
    dtype = np.float32
    room = ROOM  # past arrays may be the leading positions of buffers with room: the step grows them in place

    def __init__(self, model: StepModel) -> None:
        self.model = model
        self._attention: np.ndarray | None = None

    @cached_property
    def past(self) -> CacheLayout:
        """The decoder's cache, each layer's keys and values and cross-attention ones (read when first needed)."""
        shape: tuple[int, int, int] | None = getattr(self.model, "cache_shape", None)  # OnnxSeq2Seq's: (L, H, K)
        if shape is None:  # a model that does not say: one grapheme through its encoder shows it
            one = np.ones((1, 1), dtype=np.int64)
            keys, _ = self.model.encode(one, one)  # (L, B, H, S, K)
            shape = (keys.shape[0], keys.shape[2], keys.shape[4])
        layers, heads, head_dim = shape
        names = tuple(f"{name}_{i}" for i in range(layers) for name in _PER_LAYER)
        return CacheLayout(names, (), heads, head_dim, (True, True, False, False) * layers)

    @property
    def layers(self) -> int:
        return len(self.past.self_attention) // len(_PER_LAYER)

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B, S) graphemes and mask -> the cross-attention keys and values, (L, B, H, S, K) each."""
        return self.model.encode(ids, mask)

    def first_cache(self, hidden: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
        keys, values = hidden
        b, h, _, k = keys.shape[1:]
        empty = np.zeros((b, h, 0, k), dtype=self.dtype)
        return [a for i in range(self.layers) for a in (empty, empty, keys[i], values[i])]

    def start(self, ids: np.ndarray, hidden: tuple[np.ndarray, np.ndarray],
              mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """The first step alone (the engine joins it to a decoding call instead): one masked slot of cache."""
        past = [np.pad(a, ((0, 0), (0, 0), (0, 1), (0, 0))) if a.shape[2] == 0 else a for a in self.first_cache(hidden)]
        logits, present = self.step(ids, mask, past, np.array([[0, 1]] * len(ids), dtype=np.int64))
        return logits, [a[:, :, 1:] if own else a for a, own in zip(present, self.past.self_attention, strict=True)]

    def step(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray],
             self_mask: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """ids (B, 1), the graphemes' mask (B, S), past in `self.past`'s order, the cache's mask and the new
        token's (B, P+1) -> log-probs (B, 1, V), present (each layer's cache grown by the step's keys)."""
        b, p = len(ids), past[0].shape[2]
        grown = [past[j] for j, own in enumerate(self.past.self_attention) if own]
        held = [_room_of(a) for a in grown]
        full = [f for f in held if f is not None]
        capacity = full[0].shape[2] if len(full) == len(grown) else 0
        if any(f.shape[2] != capacity for f in full) or not capacity:  # the engine stacked them anew: one copy
            capacity = p + 1 + ROOM
            full = [np.zeros((*a.shape[:2], capacity, a.shape[3]), dtype=a.dtype) for a in grown]
            for f, a in zip(full, grown, strict=True):
                f[:, :, :p] = a
        cache_mask = np.zeros((b, capacity), dtype=np.int64)  # the slots past p: room, masked
        cache_mask[:, :p] = self_mask[:, :p] if self_mask is not None else 1
        positions = cache_mask.sum(axis=1)  # the new token's: the real slots before it
        cross = [past[j::4] for j in (2, 3)]  # cross_keys, cross_values, per layer
        log_probs, new_keys, new_values, attention = self.model.step(
            ids[:, 0], positions, full[0::2], full[1::2], cache_mask, cross[0], cross[1], mask
        )
        self._attention = attention
        present: list[np.ndarray] = []
        for i in range(self.layers):
            keys, values = full[2 * i], full[2 * i + 1]
            keys[:, :, p], values[:, :, p] = new_keys[i], new_values[i]  # in place: the next step reads them there
            present += [keys[:, :, : p + 1], values[:, :, : p + 1], cross[0][i], cross[1][i]]
        return log_probs[:, None], present

    def attention(self) -> np.ndarray | None:
        return self._attention


def _room_of(a: np.ndarray) -> np.ndarray | None:
    """The buffer whose leading positions `a` (B, H, P, K) is, when it is one with room past them: a cache
    this adapter grew in place at the last step, or the engine's resident caches (resident.py), which the
    step takes as it is, its room masked."""
    f = a.base
    if (isinstance(f, np.ndarray) and f.ndim == 4 and f.shape[0] >= a.shape[0] and f.shape[1] == a.shape[1]
            and f.shape[2] > a.shape[2] and f.shape[3] == a.shape[3] and f.flags.c_contiguous and a.strides == f.strides
            and a.__array_interface__["data"][0] == f.__array_interface__["data"][0]):  # fmt: skip
        return f[: a.shape[0]]  # its first rows: contiguous
    return None


@dataclass(eq=False)
class Outcome:
    """A word's outlet: the last message the engine sent it (its final chunk, or the error)."""

    last: Message | None = None

    def put_nowait(self, item: Message, /) -> None:
        self.last = item


def error_of(s: Sequence) -> ServingError | None:
    """The error a word's step failed with, if it did."""
    last = s.queue.last if isinstance(s.queue, Outcome) else None
    return last if isinstance(last, ServingError) else None


def word_engine(steps: WordSteps, rows: int, name: str = "g2p", compute: ComputeThreads | None = None) -> Engine:
    """An engine for words, stepped by its caller (`Engine.join`, `Engine.step`): up to `rows` words decode
    together, every new word is encoded at the step it joins, and nothing is held back by a cache budget
    (the words' requests are admitted before they join)."""
    unbounded = 1 << 62
    return Engine(name, steps, compute or ComputeThreads(), (EOS,), BOS, 0, cache_budget=unbounded,
                  step_tokens=unbounded, max_running=rows, max_waiting=0)  # fmt: skip


def word(source: list[int], max_len: int, with_attention: bool = False, tag: Any = None) -> Sequence:
    """A word to decode greedily: its graphemes, at most `max_len` phonemes (</s> counted)."""
    request = GenerationRequest(tuple(source), max_len)
    return Sequence(request, _GREEDY, None, Outcome(), attention=[] if with_attention else None, tag=tag,
                    chunks=False)  # fmt: skip


def hypothesis(s: Sequence) -> Hypothesis:
    """A decoded word as g2p's callers read it: <s>, its phonemes, </s> when it ended there."""
    h = Hypothesis(list(s.prompt), s.request.max_tokens, tokens=[BOS, *s.output], score=s.score,
                   done=bool(s.output) and s.output[-1] == EOS, tag=s.tag, attention=s.attention or [])  # fmt: skip
    h.eos = EOS
    return h


def greedy_decode(
    model: StepModel | WordSteps,
    sources: Words[Words[int]],
    max_len: int,
    batch_size: int = 256,
    with_attention: bool = False,
) -> list[Hypothesis]:
    """Greedy decoding of every source, `batch_size` words at a time, sorted by length. Raises a word's
    error (a step that failed)."""
    steps = model if isinstance(model, WordSteps) else WordSteps(model)
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    results: list[Hypothesis | None] = [None] * len(sources)
    for first in range(0, len(order), batch_size):
        engine = word_engine(steps, batch_size)
        words = [word(list(sources[i]), max_len, with_attention, tag=i) for i in order[first : first + batch_size]]
        engine.join(words)
        while engine.running:
            engine.step()
        for s in words:
            error = error_of(s)
            if error is not None:
                raise error
            results[s.tag] = hypothesis(s)
    return [h for h in results if h is not None]
