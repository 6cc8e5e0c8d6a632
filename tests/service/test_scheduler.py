"""The generation scheduler's promises, on the shipped g2p graphs: continuous batching gives each
word what it gets alone, rows join and leave mid-batch, batching off decodes alone, and beam
requests decode together without starving. Speed is for `qkv bench`.
"""

from __future__ import annotations

import asyncio
import itertools
import random

import numpy as np
import pytest

from service.decoding.words import WordSteps, greedy_decode, hypothesis, word, word_engine
from service.scheduling.admission import WorkItem
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.seq2seq.generation import beam_search
from service.seq2seq.graphs import OnnxSeq2Seq, session_options
from service.seq2seq.vocab import Vocabulary
from tests.conftest import MODELS
from tests.service.queue_helpers import FLOOD_QUEUE_WAIT_MS, Recorder, beam_beside_greedy_flood, until

# -- GenerationScheduler on the shipped g2p graphs -------------------------------------------------


@pytest.fixture(scope="module")
def g2p_graphs() -> tuple[OnnxSeq2Seq, Vocabulary]:
    version = MODELS / "g2p" / "1"
    return OnnxSeq2Seq(version, session_options(1)), Vocabulary.load(version / "graphemes.json")


def test_continuous_batching_gives_each_word_what_it_gets_alone(g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary]) -> None:
    model, graphemes = g2p_graphs
    long_words = ["internationalization", "counterrevolutionaries", "electroencephalograph", "unconstitutionally"]
    short_words = ["cat", "on", "the", "mat", "a", "dog", "ran", "far", "up", "it"]
    alone = {w: greedy_decode(model, [graphemes.encode(w)], 40)[0].output for w in long_words + short_words}

    async def run() -> tuple[dict[str, list[int]], Recorder]:
        seen = Recorder()
        scheduler = GenerationScheduler("g2p", BatchingConfig(min_join_rows=1), [model], observer=seen)
        scheduler.start()
        loop = asyncio.get_running_loop()

        async def convert(words: list[str]) -> list[list[int]]:
            sources = [graphemes.encode(w) for w in words]
            req = WordsRequest(sources, 40)
            item = WorkItem(len(sources), max(map(len, sources)) + 1, req, loop.create_future())
            return [h.output for h in await scheduler.submit(item)]

        long_task = asyncio.create_task(convert(long_words))
        await until(lambda: len(seen.batches) >= 2)  # the long words are decoding
        shorts = await asyncio.gather(*[convert([w]) for w in short_words])
        longs = await long_task
        await scheduler.close()
        return dict(zip(long_words + short_words, longs + [s[0] for s in shorts], strict=True)), seen

    served, seen = asyncio.run(run())
    assert served == alone
    rows = [r for r, _, _ in seen.batches]
    assert any(b > a > 0 for a, b in itertools.pairwise(rows)), f"no word joined a running batch: {rows}"


def test_rows_leaving_and_joining_at_one_step_decode_as_alone(g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary]) -> None:
    """Words join the running engine at random steps while others leave: the caches are restacked (the
    rows that stepped together copied as one block, the new ones beside them) and every word still gets its
    own phonemes and log-probability, and its own cross-attention rows."""
    model, graphemes = g2p_graphs
    words = ["the", "internationalization", "of", "a", "cat", "on", "counterrevolutionaries", "mat", "by", "it"]
    sources = [graphemes.encode(w) for w in [*words, "electroencephalograph", "far", "up", "dog", "ran"] * 3]
    alone = [greedy_decode(model, [s], 40, with_attention=True)[0] for s in sources]
    steps = WordSteps(model)
    rng, engine, got, merged = random.Random(0), word_engine(steps, 64), {}, 0
    i, live, left = 0, {}, False
    while i < len(sources) or live:
        if i < len(sources) and rng.random() < 0.5:
            joining = [
                word(s, 40, with_attention=True, tag=j)
                for j, s in enumerate(sources[i : i + rng.randint(1, 4)], start=i)
            ]
            engine.join(joining)
            merged += left and len(live) > 0
            live.update((w.tag, w) for w in joining)
            i += len(joining)
        left = False
        if live:
            engine.step()
        for w in [w for w in live.values() if w.finished]:
            got[w.tag] = hypothesis(live.pop(w.tag))
            left = True
    assert [got[j].output for j in range(len(sources))] == [h.output for h in alone]
    assert max(abs(got[j].score - h.score) for j, h in enumerate(alone)) < 1e-4
    assert all(np.allclose(np.array(got[j].attention), np.array(h.attention), atol=1e-5) for j, h in enumerate(alone))
    assert merged > 5, "no step had rows leaving and joining together"


def test_with_batching_off_a_request_decodes_alone(g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary]) -> None:
    model, graphemes = g2p_graphs
    words = ["internationalization", "cat", "on", "the", "mat", "dog"]
    alone = {w: greedy_decode(model, [graphemes.encode(w)], 40)[0].output for w in words}

    async def run() -> tuple[list[list[int]], Recorder]:
        seen = Recorder()
        scheduler = GenerationScheduler("g2p", BatchingConfig(enabled=False, min_join_rows=1), [model], observer=seen)
        scheduler.start()
        loop = asyncio.get_running_loop()

        async def convert(word: str) -> list[int]:
            item = WorkItem(1, len(word) + 1, WordsRequest([graphemes.encode(word)], 40), loop.create_future())
            (hyp,) = await scheduler.submit(item)
            return hyp.output

        served = await asyncio.gather(*[convert(w) for w in words])
        await scheduler.close()
        return served, seen

    served, seen = asyncio.run(run())
    assert served == [alone[w] for w in words]
    assert {rows for rows, _, _ in seen.batches} == {1}, "a word joined another request's decode"


def test_waiting_beam_requests_decode_together_and_each_is_answered_when_its_words_are_done(
    g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary],
) -> None:
    model, graphemes = g2p_graphs
    requests = [(["internationalization"], 4), (["cat"], 4), (["on", "the", "mat"], 4), (["dog"], 2),
                (["counterrevolutionaries", "a"], 4)]  # fmt: skip
    alone = [[h.output for h in beam_search(model, [graphemes.encode(w) for w in ws], k, 40)] for ws, k in requests]

    async def run() -> tuple[list[list[list[int]]], list[int], Recorder]:
        seen = Recorder()
        scheduler = GenerationScheduler("g2p", BatchingConfig(), [model], observer=seen)
        loop = asyncio.get_running_loop()
        answered: list[int] = []

        async def convert(i: int, words: list[str], k: int) -> list[list[int]]:
            sources = [graphemes.encode(w) for w in words]
            item = WorkItem(
                len(sources), max(map(len, sources)) + 1, WordsRequest(sources, 40, k), loop.create_future()
            )
            hyps = await scheduler.submit(item)
            answered.append(i)
            return [h.output for h in hyps]

        tasks = [asyncio.create_task(convert(i, ws, k)) for i, (ws, k) in enumerate(requests)]
        await asyncio.sleep(0.05)  # all queued before the decoding thread starts: one batch is possible
        scheduler.start()
        served = await asyncio.gather(*tasks)
        await scheduler.close()
        return served, answered, seen

    served, answered, seen = asyncio.run(run())
    assert served == alone
    # The beam-4 requests share one batch (7 words x 4 beams); the beam-2 one cannot join it.
    assert sorted(rows for rows, _, _ in seen.batches) == [1 * 2, 7 * 4]
    assert answered.index(1) < answered.index(0), "'cat' waited for 'internationalization' to finish"
    assert answered.index(1) < answered.index(4)


def test_a_beam_request_is_not_starved_by_a_batch_that_never_empties(
    g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary],
) -> None:
    """With more greedy words waiting than a batch holds, joins come every step and the greedy batch
    never empties: the beam search runs beside it, its steps taking turns with the batch's."""
    model, graphemes = g2p_graphs
    (expected,) = beam_search(model, [graphemes.encode("pronunciation")], 4, 40)
    seen = Recorder()
    config = BatchingConfig(max_batch_size=16, max_queue_wait_ms=FLOOD_QUEUE_WAIT_MS)
    scheduler = GenerationScheduler("g2p", config, [model], observer=seen)
    beam, mark = asyncio.run(beam_beside_greedy_flood(scheduler, graphemes, lambda: len(seen.batches), beam_rows=1))
    assert beam == expected.output
    assert mark >= 20 and len(seen.batches) > mark  # it was sent into the flood, and the flood stepped beside it


def test_capacity_is_measured_only_from_steps_that_could_take_no_more_words(
    g2p_graphs: tuple[OnnxSeq2Seq, Vocabulary],
) -> None:
    """Words waiting for company (fewer than min_join_rows) beside a one-word batch say nothing of what
    a full batch serves; words waiting beside a full batch do."""
    model, graphemes = g2p_graphs

    async def run(config: BatchingConfig, first: list[str], then: list[str]) -> float:
        seen = Recorder()
        scheduler = GenerationScheduler("g2p", config, [model], observer=seen)
        scheduler.start()
        loop = asyncio.get_running_loop()

        async def convert(words: list[str]) -> None:
            sources = [graphemes.encode(w) for w in words]
            item = WorkItem(len(sources), max(map(len, sources)) + 1, WordsRequest(sources, 40), loop.create_future())
            await scheduler.submit(item)

        running = asyncio.create_task(convert(first))
        await until(lambda: len(seen.batches) >= 1)
        await asyncio.gather(running, *[convert([w]) for w in then])
        await scheduler.close()
        return scheduler.admission.tokens_per_second

    long_word, short_words = ["counterrevolutionaries"], ["cat", "dog", "up"]
    # Three words wait (up to 30 ms) for a fourth beside a batch of one: not capacity.
    waiting = BatchingConfig(min_join_rows=4, max_queue_delay_ms=30)
    assert asyncio.run(run(waiting, long_word, short_words)) == 0
    # A batch of two is full while more words wait: capacity, measured.
    full = BatchingConfig(max_batch_size=2, min_join_rows=1)
    assert asyncio.run(run(full, ["internationalization", "electroencephalograph"], short_words)) > 0
