"""The generation engine's step planning (service/models/generation/planning.py): which sequences decode and
how much of which prompts runs each step. A pure function, checked with an injected step cost, not wall time."""

from __future__ import annotations

import numpy as np

from service.decoding.planning import MIN_CHUNK, PREFILL_SHARE, plan_step, step_budget

BUDGET = 256


def _cost(decode: int, prefill: int) -> float:
    """An injected step cost: a fixed part, a part a decoding row, a part a prompt token (prefill's tokens
    each cost a tenth of a decoding row's, as a batched matmul makes them)."""
    return 1.0 + 0.05 * decode + 0.01 * prefill


def _intervals(budget: int, streams: int = 15, prompt: int = 2000, tokens: int = 100) -> list[float]:
    """The gaps between the tokens of `streams` running sequences while a `prompt`-token prompt arrives at
    their 10th token and is prefilled, under `budget`."""
    remaining = [0] * streams
    clock, last, gaps = 0.0, [0.0] * streams, []
    for step in range(tokens):
        if step == 10:
            remaining.append(prompt)
        plan = plan_step(remaining, budget)
        assert set(plan.decode) >= set(range(streams))  # every running stream decodes every step
        for i, n in plan.prefill:
            remaining[i] -= n
        clock += _cost(len(plan.decode), sum(n for _, n in plan.prefill))
        for i in range(streams):
            gaps.append(clock - last[i])
            last[i] = clock
    return gaps


def test_a_long_prompt_is_prefilled_in_chunks_that_keep_the_streams_inter_token_p99_within_3x_median() -> None:
    gaps = np.array(_intervals(BUDGET))
    assert np.percentile(gaps, 99) <= 3 * np.median(gaps)
    whole = np.array(_intervals(1 << 20))  # the prompt in one step: one gap of the whole prefill's cost
    assert whole.max() > 10 * np.median(whole)


def test_decoding_rows_always_run_and_prompts_share_what_is_left_first_come_first_served() -> None:
    plan = plan_step([0, 0, 300, 0, 50], budget=100)
    assert plan.decode == (0, 1, 3)
    assert plan.prefill == ((2, 97),)  # the oldest prompt takes the room; the next waits
    assert plan.tokens == 100
    assert plan_step([0, 20, 30], budget=100).prefill == ((1, 20), (2, 30))


def test_the_oldest_prompt_moves_on_even_when_decoding_fills_the_budget() -> None:
    plan = plan_step([0] * 40 + [500, 10], budget=32)
    assert len(plan.decode) == 40
    assert plan.prefill == ((40, MIN_CHUNK),)


def test_an_encoder_reads_a_prompt_whole_or_it_waits() -> None:
    plan = plan_step([0, 0, 120, 500, 30], budget=200, chunked=False)
    assert plan.prefill == ((2, 120), (4, 30))  # 500 would pass the budget: it waits, a shorter one goes
    assert plan_step([0, 900], budget=200, chunked=False).prefill == ((1, 900),)  # the oldest always goes


def test_while_streams_decode_a_step_takes_the_prompt_tokens_its_measured_cost_allows() -> None:
    # a decoding step of 15 rows costs 2 ms, a prompt token 0.05 ms: 40 prompt tokens cost as much
    assert step_budget(15, 256, 0.002, 0.00005) == 15 + int(PREFILL_SHARE * 40)
    assert step_budget(0, 256, 0.002, 0.00005) == 256  # nothing decodes: the whole budget to prompts
    assert step_budget(15, 256, 0.0, 0.0) == 256  # nothing measured yet
    assert step_budget(15, 256, 0.002, 0.01) == 15 + MIN_CHUNK  # prefill always moves on
    assert step_budget(15, 64, 0.002, 0.000001) == 64  # never past batching.token_budget
