"""The text kind's graph served as a tensor model: token rows batched by length, each batch's outputs pooled
(or scored) on the thread that ran it, and the kind's own warm-up measurements (service/models/text/batching.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any, cast

import numpy as np

from service.errors import ServingError
from service.models.common import ModelStats
from service.models.runtime import TensorRuntime
from service.models.tensor.model import TensorModel
from service.models.text.batching import (
    INLINE_LENGTHS,
    SENTENCE_TOKENS,
    SHORT_LENGTH,
    SHORT_ROWS,
    inline_tokens,
    lone_times,
    short_rows,
    text_tuning,
)
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig
from service.scheduling.admission import WorkItem
from service.scheduling.batching import LONE

__all__ = ["POOLED", "Encoder"]

log = logging.getLogger("qkv.models")

POOLED = "POOLED"  # what a batch step hands back: (rows, D) pooled, or (rows, C) scores


class Encoder(TensorModel):
    """The graph as a tensor model (token rows batched by length); each batch's outputs turned into pooled
    embeddings or scores where the batch ran: on an instance's thread, so the event loop only gathers
    vectors, or on the loop's own for a text alone computed there."""

    def __init__(self, config: ModelConfig, runtime: TensorRuntime, observer: ModelObserver,
                 head: Callable[[dict[str, np.ndarray], np.ndarray], np.ndarray], output: str,
                 compute: ComputeThreads) -> None:  # fmt: skip
        super().__init__(config, runtime, observer, compute)
        self.head, self.output = head, output

    def warm_up(self, length: int = 64) -> None:
        """The tensor kind's warm-up and sweep, then a batch's own cost timed on short rows as served, and the
        batching settings from both; with a lone session, the longest text alone it computes on the event
        loop's thread (service/models/text/batching.py)."""
        super().warm_up(length)
        if self.tuning is None or self.batcher.cost is None or length < SENTENCE_TOKENS:
            return  # a model of fewer tokens than the short rows keeps the sweep's settings
        short = short_rows(lambda n, rows: self.batcher.served_seconds(partial(self._batch_of, n, rows)))
        self.tuning = text_tuning(self.tuning, self.batcher.cost, short, length)
        self.batcher.use(self.tuning, self.batcher.cost)
        log.info("batching %s (text: 1 and %d rows of %d tokens, 1 of %d, took %.3f, %.3f and %.3f ms)",
                 self.tuning.summary(self.name), SHORT_ROWS, SHORT_LENGTH, SENTENCE_TOKENS, short.one * 1e3,
                 short.many * 1e3, short.sentence * 1e3)  # fmt: skip
        lengths = tuple(n for n in INLINE_LENGTHS if self.batcher.lone_min_tokens <= n <= self.max_sequence_length)
        if self.batcher.lone and lengths and "inline_max_tokens" not in self.config.batching_given:
            self._choose_inline(lengths)
        self.stats = ModelStats()  # the statistics count requests, not warm-up batches

    def _choose_inline(self, lengths: tuple[int, ...]) -> None:
        """How long a request alone, on the lone session, may be to run on the event loop's thread
        (service/models/text/batching.py), from one request of each of `lengths` timed on it: the text kind's
        bound, or the tensor kind's where that allows more."""
        times = lone_times(self._lone_seconds, lengths)
        tokens = inline_tokens(times, self.batcher.lone_min_tokens)
        self.batcher.lone_inline_max_tokens = max(self.batcher.lone_inline_max_tokens, tokens)
        log.info("model '%s': a text alone of up to %d tokens runs on the event loop's thread (on every core, by "
                 "tokens: %s)", self.name, self.batcher.lone_inline_max_tokens,
                 ", ".join(f"{t}: {s * 1e3:.2f} ms" for t, s in times))  # fmt: skip

    def _lone_seconds(self, length: int) -> float:
        """Seconds of one request of `length` tokens through the batch step on the lone session, as a request
        computed on the event loop's thread runs."""
        feeds = self._feeds(1, length)
        unused = cast("asyncio.Future[Any]", None)  # the batch step reads payloads only
        item = WorkItem(rows=1, length=length, payload=(feeds, [self.output], self._group(feeds)), future=unused)
        t0 = time.perf_counter()
        (result,) = self._run_batch([item], LONE)
        seconds = time.perf_counter() - t0
        if isinstance(result, ServingError):
            raise result  # the warm-up's own inputs: the graph cannot run them
        return seconds

    def _run_batch(self, items: list[WorkItem], instance: int) -> list[dict[str, np.ndarray] | ServingError]:
        """The tensor kind's batch (a request that fails gets its error alone), each answer pooled."""
        results = super()._run_batch(items, instance)
        return [
            r if isinstance(r, ServingError) else {POOLED: self.head(x.payload[0], r[self.output])}
            for x, r in zip(items, results, strict=True)
        ]
