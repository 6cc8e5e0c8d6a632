"""The text kind's batching settings from measured costs (service/models/text/batching.py), decided from
injected timings: a sweep of rows of 64 tokens that shows no fixed cost, and short rows that show it."""

from __future__ import annotations

import pytest

from service.models.text.batching import (
    MIN_BATCH_ROWS,
    SENTENCE_TOKENS,
    SHORT_RUNS,
    ShortRows,
    padding_share,
    short_rows,
    text_tuning,
)
from service.scheduling.config import BatchingConfig
from service.scheduling.tuning import CostModel, Tuning, tune

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
