"""The text kind's batching settings from measured costs (service/models/text/batching.py), decided from
injected timings: a sweep of rows of 64 tokens that shows no fixed cost, and short rows that show it; and
which requests alone are computed on the event loop's thread."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from service.models.text.batching import (
    INLINE_LENGTHS,
    INLINE_SECONDS,
    MIN_BATCH_ROWS,
    SENTENCE_TOKENS,
    SHORT_RUNS,
    ShortRows,
    inline_tokens,
    lone_times,
    padding_share,
    short_rows,
    text_tuning,
)
from service.scheduling.admission import WorkItem
from service.scheduling.batching import LONE, DynamicBatcher
from service.scheduling.config import BatchingConfig
from service.scheduling.loop_idle import new_event_loop
from service.scheduling.tuning import QUIET_ARRIVALS, CostModel, Tuning, tune

ROW_64 = 2e-3  # seconds a row of 64 tokens costs, in a batch of any size: the sweep sees no fixed cost


def sweep_tuning(given: frozenset[str] = frozenset()) -> tuple[Tuning, CostModel]:
    """What the tensor kind's sweep decides for an encoder whose rows of 64 tokens cost ROW_64 each."""
    points = [(64 * rows, rows * ROW_64) for rows in (1, 2, 4, 8, 16, 32)]
    cost = CostModel.fit(points)
    return tune(BatchingConfig(), given, points, 1e-4, cost), cost


def test_the_sweep_alone_shows_no_fixed_cost_and_batches_one_row() -> None:
    tuning, cost = sweep_tuning()
    assert cost.fixed == pytest.approx(0.0, abs=1e-9)
    assert tuning.config.max_queue_delay_ms == 0.0  # a partial batch never waits for company
    assert tuning.config.token_budget == 64  # one row of 64 tokens


def test_a_batch_fixed_cost_is_one_row_less_what_a_row_adds() -> None:
    assert ShortRows(3e-3, 6e-3, 4e-3).fixed() == pytest.approx(2e-3)  # a row adds 1 ms: the batch itself, 2 ms
    assert ShortRows(3e-3, 12e-3, 4e-3).fixed() == 0.0  # rows cost the same alone or batched: nothing to save
    assert ShortRows(3e-3, 14e-3, 4e-3).fixed() == 0.0  # noise never makes it negative
    assert ShortRows(3e-3, 6e-3, 4.6e-3).per_token() == pytest.approx(0.1e-3)  # 16 more tokens, 1.6 ms
    assert ShortRows(3e-3, 6e-3, 2.9e-3).per_token() == 0.0


def test_short_rows_keep_the_best_of_each_size_timed_in_turns() -> None:
    calls: list[tuple[int, int]] = []
    times = iter([5.0, 9.0, 7.0, 4.0, 11.0, 6.0, 6.0, 8.0, 9.0] + [10.0] * 3 * (SHORT_RUNS - 3))

    def run(length: int, rows: int) -> float:
        calls.append((length, rows))
        return next(times)

    assert short_rows(run) == ShortRows(4.0, 8.0, 6.0)
    assert calls == [(16, 1), (16, 4), (SENTENCE_TOKENS, 1)] * SHORT_RUNS


@pytest.mark.parametrize(
    ("short", "share"),
    [
        (ShortRows(2.5e-3, 8.5e-3, 4.1e-3), 0.156),  # 0.5 ms of batch buys 5 padded tokens of a 32-token batch
        (ShortRows(3.6e-3, 8.4e-3, 5.2e-3), 0.5),  # 2 ms: at most half of a batch padding
        (ShortRows(2e-3, 8e-3, 3.6e-3), 0.1),  # no fixed cost: the tensor kind's default, not less
        (ShortRows(3e-3, 6e-3, 3e-3), 0.5),  # padding costs nothing measurable
    ],
)
def test_the_padding_share_is_what_one_batch_fewer_pays_for(short: ShortRows, share: float) -> None:
    assert padding_share(short) == share


def test_the_text_tuning_waits_for_company_pads_and_holds_several_texts() -> None:
    tuning, cost = sweep_tuning()
    short = ShortRows(1.0e-3, 3.4e-3, 1.8e-3)  # the batch 0.2 ms, a row's token 50 us
    tuned = text_tuning(tuning, cost, short, length=64)
    c = tuned.config
    assert cost.fixed == pytest.approx(0.2e-3)  # the batcher's cost model now has the fixed cost
    assert c.max_queue_delay_ms == pytest.approx(0.2)  # one batch's fixed cost: waiting for one more pays
    assert c.token_budget == MIN_BATCH_ROWS * 64
    assert c.max_padding == round(0.2e-3 / (50e-6 * SENTENCE_TOKENS), 3) == 0.125
    assert set(tuned.reasons) >= {"max_padding", "token_budget", "max_queue_delay_ms", "inline_max_tokens"}
    assert "max_padding 0.125 (padding that computes in one batch's fixed cost" in tuned.summary("m")


def test_a_fixed_cost_below_the_fit_keeps_the_fit() -> None:
    points = [(64 * rows, 1e-3 + rows * ROW_64) for rows in (1, 2, 4, 8)]
    cost = CostModel.fit(points)
    tuning = tune(BatchingConfig(), frozenset(), points, 1e-4, cost)
    tuned = text_tuning(tuning, cost, ShortRows(1.0e-3, 3.7e-3, 1.8e-3), length=64)  # 0.1 ms
    assert tuned.config.max_queue_delay_ms == pytest.approx(1.0)


def test_what_config_json_gives_is_kept() -> None:
    given = frozenset({"max_padding", "max_queue_delay_ms", "token_budget"})
    config = BatchingConfig(max_padding=0.05, max_queue_delay_ms=7.0, token_budget=100)
    points = [(64 * rows, rows * ROW_64) for rows in (1, 2, 4)]
    cost = CostModel.fit(points)
    tuned = text_tuning(tune(config, given, points, 1e-4, cost), cost, ShortRows(3e-3, 6e-3, 4e-3), length=64)
    assert (tuned.config.max_padding, tuned.config.max_queue_delay_ms, tuned.config.token_budget) == (0.05, 7.0, 100)
    assert tuned.reasons["max_padding"] == tuned.reasons["token_budget"] == "config.json"


def encoder_tuning(row_64: float, handoff: float = 1e-4) -> tuple[Tuning, CostModel]:
    """The sweep's settings for an encoder whose rows of 64 tokens cost `row_64` each, in batches of any size."""
    points = [(64 * rows, rows * row_64) for rows in (1, 2, 4, 8)]
    cost = CostModel.fit(points)
    return tune(BatchingConfig(), frozenset(), points, handoff, cost), cost


def test_the_text_tuning_computes_a_text_alone_on_the_loop_up_to_the_inline_bound() -> None:
    # rows of 64 tokens in 16 ms: the tensor kind's rule (20 hand-offs of 0.1 ms) computes 8 tokens inline
    tuning, cost = encoder_tuning(16e-3)
    assert tuning.config.inline_max_tokens == 8
    # one row of 16 tokens in 4 ms, one of 32 in 8 ms, as served: 32 is within 10 ms
    tuned = text_tuning(tuning, cost, ShortRows(4e-3, 14e-3, 8e-3), length=64)
    assert tuned.config.inline_max_tokens == SENTENCE_TOKENS
    assert f"a text alone computing in at most {INLINE_SECONDS * 1e3:g} ms" in tuned.reasons["inline_max_tokens"]
    # 32 tokens in 14 ms: up to where the line from 16 tokens (4 ms) reaches 10 ms, 16 + 16 x 6 / 10
    assert text_tuning(tuning, cost, ShortRows(4e-3, 14e-3, 14e-3), 64).config.inline_max_tokens == 25
    # a row of 16 tokens over the bound: the tensor kind's rule stands
    slow = text_tuning(tuning, cost, ShortRows(11e-3, 40e-3, 20e-3), length=64)
    assert slow.config.inline_max_tokens <= 8
    assert "hand-offs" in slow.reasons["inline_max_tokens"]
    # the tensor kind's rule allowing more (rows of 64 tokens in 2 ms) is kept
    quick, fit = encoder_tuning(2e-3)
    assert text_tuning(quick, fit, ShortRows(1e-3, 3.4e-3, 1.8e-3), 64).config.inline_max_tokens > SENTENCE_TOKENS
    # config.json's is the whole rule
    points = [(64 * rows, rows * 16e-3) for rows in (1, 2, 4)]
    given = tune(BatchingConfig(inline_max_tokens=0), frozenset({"inline_max_tokens"}), points, 1e-4, fit)
    kept = text_tuning(given, fit, ShortRows(4e-3, 14e-3, 8e-3), 64)
    assert kept.config.inline_max_tokens == 0 and kept.reasons["inline_max_tokens"] == "config.json"


def test_a_lone_text_runs_on_the_loop_up_to_where_its_time_reaches_the_bound() -> None:
    # all-MiniLM-L6-v2 on every core of an idle 2-core machine, about: a 32-token row 6 ms, 64 tokens 10.5
    times = [(8, 2.5e-3), (16, 3.4e-3), (32, 5.9e-3), (64, 10.5e-3)]
    assert inline_tokens(times, 8) == 32 + int(32 * (10e-3 - 5.9e-3) / (10.5e-3 - 5.9e-3)) == 60
    assert inline_tokens(times, 8, bound=12e-3) == 64  # every length within it: the longest timed, no further
    assert inline_tokens(times, 64) == 0  # from the lone session's threshold on: 64 alone is over the bound
    assert inline_tokens(times, 16, bound=3e-3) == 0  # none within it
    assert inline_tokens([(8, 2e-3), (16, 1.5e-3), (32, 11e-3)], 8) == 16 + int(16 * 8.5 / 9.5)  # noise: 16 < 8
    assert inline_tokens([(8, 2e-3), (16, 12e-3), (32, 5e-3)], 8) == 8 + int(8 * 8 / 10)  # none past the first over


def test_lone_times_keep_the_best_of_each_length_timed_in_turns() -> None:
    calls: list[int] = []
    times = iter([5.0, 9.0, 7.0, 8.0, 4.0, 11.0, 6.0, 9.0] + [10.0] * len(INLINE_LENGTHS) * (SHORT_RUNS - 2))

    def run(length: int) -> float:
        calls.append(length)
        return next(times)

    assert lone_times(run, bound=20.0) == list(zip(INLINE_LENGTHS, [4.0, 9.0, 6.0, 8.0], strict=True))
    assert calls == list(INLINE_LENGTHS) * SHORT_RUNS


def test_lone_times_stop_at_the_first_length_over_the_bound() -> None:
    seconds = {8: 4e-3, 16: 12e-3, 32: 20e-3, 64: 40e-3}
    calls: list[int] = []

    def run(length: int) -> float:
        calls.append(length)
        return seconds[length]

    assert lone_times(run) == [(8, 4e-3), (16, 12e-3)]  # 16 tokens over 10 ms: 32 and 64 never timed
    assert calls == [8] + [16] * SHORT_RUNS + [8, 16] * (SHORT_RUNS - 1)  # 16 over it in every try first


def test_a_cold_first_run_over_the_bound_does_not_stop_the_timing() -> None:
    cold = {8: [15e-3, 3e-3], 16: [4e-3], 32: [6e-3], 64: [11e-3] * SHORT_RUNS}
    calls: list[int] = []

    def run(length: int) -> float:
        calls.append(length)
        return cold[length].pop(0) if len(cold[length]) > 1 else cold[length][0]

    times = dict(lone_times(run))
    assert times == {8: 3e-3, 16: 4e-3, 32: 6e-3, 64: 11e-3}  # 8 tokens timed again, not taken as over 10 ms
    assert calls[:2] == [8, 8]


class Recorder:
    """A text model's batch step for the batcher: each request's payload back, after `seconds`; records the
    instance and the thread of each batch, and its size."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.instances: list[int] = []
        self.threads: list[int] = []
        self.sizes: list[int] = []

    def __call__(self, items: list[WorkItem], instance: int) -> list[Any]:
        self.instances.append(instance)
        self.threads.append(threading.get_ident())
        self.sizes.append(len(items))
        time.sleep(self.seconds)
        return [x.payload for x in items]


def test_sentences_one_at_a_time_run_alone_on_the_loop_and_a_burst_after_them_is_batched() -> None:
    """The text kind's decisions in a batcher: a 34-token sentence alone, its lone run (2 ms here) within the
    bound, is computed on the loop's thread on every core; a burst of 31 concurrent ones is queued and
    batched on an instance, the first of them only on the loop (the others arrived while it computed)."""
    tuning, cost = encoder_tuning(16e-3)
    tuned = text_tuning(tuning, cost, ShortRows(20e-3, 60e-3, 40e-3), length=64)  # on an instance: 8 tokens
    assert tuned.config.inline_max_tokens < 34

    async def run() -> None:
        model = Recorder(seconds=0.002)
        b = DynamicBatcher("m", tuned.config, model, instances=1, lone=True)
        b.use(tuned, cost)
        b.lone_min_tokens = 8
        b.lone_inline_max_tokens = inline_tokens([(32, 2e-3), (64, 4e-3)], b.lone_min_tokens)
        b.start()
        loop = asyncio.get_running_loop()
        loop_thread = threading.get_ident()

        def sentence(k: int) -> WorkItem:
            return WorkItem(1, 34, k, loop.create_future())

        for k in range(QUIET_ARRIVALS + 2):  # one at a time: the pacing counts them before any goes inline
            assert await b.submit(sentence(k)) == k
            await asyncio.sleep(0.005)
        c1 = len(model.threads)
        assert model.threads[-2:] == [loop_thread] * 2 and model.instances[-2:] == [LONE, LONE]
        burst = await asyncio.gather(*(b.submit(sentence(100 + k)) for k in range(31)))
        assert burst == [100 + k for k in range(31)]
        on_loop = [t == loop_thread for t in model.threads[c1:]]
        assert on_loop[0] and not any(on_loop[1:]), "after the first, the burst waited behind it: handed off"
        assert sum(model.sizes[c1 + 1 :]) == 30 and len(model.sizes) - c1 - 1 <= 3, "queued and batched"
        await b.close()

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())
