"""What the queueing tests share: an observer that records, a wait for a condition, a blocker request and a
wait until it holds a one-instance g2p_encoder computing, and a model's served statistics."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from service import protocol
from service.scheduling.admission import WorkItem
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.seq2seq.vocab import Vocabulary
from service.tools.bench.servers import scrape
from service.tools.loadgen import encoder_request
from tests.conftest import RunningServer


class Recorder:
    """A BatchObserver that keeps what the scheduler reports."""

    def __init__(self) -> None:
        self.batches: list[tuple[int, int, int]] = []  # rows, padded tokens, real tokens
        self.drops: list[str] = []
        self.failures: list[str] = []  # computation_failed's scopes

    def queue_depth(self, requests: int) -> None: ...
    def waited(self, seconds: float) -> None: ...
    def capacity(self, wait_seconds: Any, utilization: Any) -> None: ...

    def batch(self, rows: int, padded_tokens: int, real_tokens: int, compute_seconds: float) -> None:
        self.batches.append((rows, padded_tokens, real_tokens))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)

    def computation_failed(self, scope: str) -> None:
        self.failures.append(scope)


async def until(condition: Any, what: str = "the condition", timeout: float = 60.0) -> None:
    """Poll `condition` on the event loop until it holds. The deadline is generous, far beyond what a loaded
    machine needs: it only bounds a test whose condition never comes, and says which."""
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"not within {timeout:g} s: {what}"
        await asyncio.sleep(0.001)


def model_stats(stub: Any, model: str) -> Any:
    """The server's ModelStatistics entry for `model` (`stub`: a `protocol.Stub`)."""
    return stub.ModelStatistics(protocol.ModelStatisticsRequest(name=model), timeout=5).model_stats[0]


async def until_computing(server: RunningServer, first: Any) -> None:
    """Until the blocker `first` is the one request in g2p_encoder and none is queued: it is computing."""
    end = time.monotonic() + 60
    while not computing_alone(server):
        assert not first.done(), "the blocker was answered before it was seen computing"
        assert time.monotonic() < end, "the blocker never started computing (60 s)"
        await asyncio.sleep(0.02)


ENCODER_VOCAB = 33  # g2p_encoder's input vocabulary
# g2p_encoder's config.json changes for the response cache's tests: its answers kept, one instance, and a queue
# that holds a blocker's rows and the requests behind it
ENCODER_CACHED = {
    "instances": 1,
    "response_cache": {"enable": True},
    "batching": {"inline_max_tokens": 0, "max_queue_wait_ms": 600_000, "max_queue_tokens": 65536},
}


def blocker_request(rows: int, rng: np.random.Generator) -> Any:
    """`rows` x 512 tokens for g2p_encoder in one request: seconds of work that hold the instance computing it."""
    request = encoder_request(512, ENCODER_VOCAB, rng)
    ids = np.frombuffer(request.raw_input_contents[0], dtype=np.int64)
    request.inputs[0].shape[:] = request.inputs[1].shape[:] = [rows, 512]
    request.raw_input_contents[:] = [np.tile(ids, rows).tobytes(), np.ones(rows * 512, np.int64).tobytes()]
    return request


def computing_alone(server: RunningServer) -> bool:
    """Whether g2p_encoder has one request in flight and none queued (a blocker computing)."""
    metrics = scrape(server.metrics_url)
    inflight = metrics.get('qkv_inflight_requests{model="g2p_encoder",version="1"}', 0)
    return inflight == 1 and metrics.get('qkv_queue_depth{model="g2p_encoder",version="1"}', 0) == 0


FLOOD_WORDS = ["cat", "internationalization", "on", "the", "counterrevolutionaries", "mat", "dog", "a"]


# The flood's queue-wait objective: what is tested is the order of steps, not admission, and on a slow moment
# of a busy machine the default 1 s refused one of the flood's own requests (predicted 1007 ms).
FLOOD_QUEUE_WAIT_MS = 600_000.0


async def beam_beside_greedy_flood(
    scheduler: GenerationScheduler, graphemes: Vocabulary, steps: Callable[[], int], beam_rows: int
) -> tuple[list[int], int]:
    """48 clients loop one-word greedy requests (three batches' worth at max_batch_size 16) until `steps()`
    passes 20; then one beam-4 request of "pronunciation" (a WorkItem of `beam_rows` rows). Its output, and
    `steps()` when it was sent. The scheduler is started here and closed after."""
    scheduler.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    async def convert(word: str, beam_size: int = 1) -> list[int]:
        src = graphemes.encode(word)
        rows = beam_rows if beam_size > 1 else 1
        (hyp,) = await scheduler.submit(
            WorkItem(rows, len(src) + 1, WordsRequest([src], 40, beam_size), loop.create_future())
        )
        return list(hyp.output)

    async def client(i: int) -> None:
        while not stop.is_set():
            await convert(FLOOD_WORDS[i % len(FLOOD_WORDS)])
            i += 1

    flood = [asyncio.create_task(client(i)) for i in range(48)]
    await until(lambda: steps() >= 20, "the greedy flood's steps")
    mark = steps()
    try:
        beam = await convert("pronunciation", 4)
    finally:
        stop.set()
        await asyncio.gather(*flood)
        await scheduler.close()
    return beam, mark
