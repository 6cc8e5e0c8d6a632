"""The text kind's batching settings, from its measured cost (docs/text-models.md, "Batching").

The tensor kind's sweep times batches of 1, 2, 4 ... rows of the warm-up's 64 tokens and fits a batch's
time as `fixed + per_token x padded tokens` (service/scheduling/tuning.py). An encoder on CPU costs about
the same per row of 64 tokens at any batch size, so that sweep shows no fixed cost: all-MiniLM-L6-v2 fitted
"0.000 ms + 331.8 us/token", which made the queue delay 0 and left the tensor kind's default `max_padding`
of 0.1 in force. Texts are short and of every length: under c32, twenty-word texts of 25 to 35 tokens
were taken three to a batch from a queue of thirty, the others too far from the oldest in length to share
10 % of padding. A batch's own cost shows where rows are short: the text kind also times one row and
SHORT_ROWS rows of SHORT_LENGTH tokens, as served, and takes the first less the marginal cost of a row as
what one batch fewer saves (`batch_fixed`). With that as the cost model's fixed cost:

- `max_queue_delay_ms` and `inline_max_tokens` follow the tensor kind's rules (`tune`);
- `max_padding` is the padded share whose compute equals one batch's fixed cost, for a sentence of
  SENTENCE_TOKENS tokens: `fixed / (per_token x SENTENCE_TOKENS)`, within PADDING_SHARES. Run apart, two
  texts pay one more batch; run together, the shorter one's padding: padding is worth it up to that. The
  share matters for short texts (a batch of long ones reaches the token budget in a few rows), so it is
  the share of a short text's batch: 0.12 at 64 tokens where it is 0.25 at 32, on the same measurement;
- `token_budget` holds at least MIN_BATCH_ROWS texts of the warm-up's length (the sweep's rule alone,
  the fewest tokens within 97 % of the best throughput, chose one row of 64 tokens).

Values given in config.json win, as for the tensor kind.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from service.scheduling.tuning import SWEEP_RUNS, CostModel, Tuning, tune

__all__ = [
    "MIN_BATCH_ROWS",
    "PADDING_SHARES",
    "SENTENCE_TOKENS",
    "SHORT_LENGTH",
    "SHORT_ROWS",
    "batch_fixed",
    "padding_share",
    "short_batches",
    "text_tuning",
]

SHORT_LENGTH = 16  # tokens of the rows timed for a batch's own cost
SHORT_ROWS = 4  # ... one row, and this many
MIN_BATCH_ROWS = 8  # a tuned token budget holds at least this many texts of the warm-up's length
SENTENCE_TOKENS = 32  # a twenty-word sentence's tokens: the text whose batches max_padding is chosen for
PADDING_SHARES = (0.1, 0.5)  # max_padding's bounds: the tensor kind's default, and half of a batch padding


def short_batches(run: Callable[[int], float]) -> tuple[float, float]:
    """Best seconds of SWEEP_RUNS of one row and of SHORT_ROWS rows (`run(rows)`), timed in turns as the sweep's
    sizes are."""
    best = {1: float("inf"), SHORT_ROWS: float("inf")}
    for _ in range(SWEEP_RUNS):
        for rows in best:
            best[rows] = min(best[rows], run(rows))
    return best[1], best[SHORT_ROWS]


def batch_fixed(one: float, many: float, rows: int = SHORT_ROWS) -> float:
    """What one batch fewer saves: a batch of one row (`one` seconds) less what a row adds to a batch, from a
    batch of `rows` rows of the same length (`many` seconds)."""
    return max(0.0, one - (many - one) / (rows - 1))


def padding_share(cost: CostModel, length: int = SENTENCE_TOKENS) -> float:
    """The padded share of a batch of texts of `length` tokens whose compute is one batch's fixed cost."""
    low, high = PADDING_SHARES
    if cost.per_token <= 0:
        return high  # padding costs nothing measurable
    return round(min(max(cost.fixed / (cost.per_token * length), low), high), 3)


def text_tuning(tuning: Tuning, cost: CostModel, fixed: float, length: int) -> Tuning:
    """The settings over `tuning` (the sweep's), for texts of `length` tokens, once `cost` (the sweep's fit)
    takes `fixed` seconds as a batch's fixed cost where it is more than the fit's (it is changed here)."""
    cost.fixed = max(cost.fixed, fixed)
    given = tuning.given
    tuned = tune(tuning.config, given, list(cost.samples), tuning.handoff_ms / 1e3, cost)
    changes: dict[str, Any] = {}
    reasons = dict(tuned.reasons)
    floor = MIN_BATCH_ROWS * length
    if "token_budget" not in given and tuned.config.token_budget < floor:
        changes["token_budget"] = floor
        reasons["token_budget"] = f"at least {MIN_BATCH_ROWS} texts of {length} tokens"
    if "max_padding" in given:
        reasons["max_padding"] = "config.json"
    else:
        changes["max_padding"] = padding_share(cost)
        reasons["max_padding"] = f"padding that computes in one batch's fixed cost, texts of {SENTENCE_TOKENS} tokens"
    return replace(tuned, config=replace(tuned.config, **changes), reasons=reasons)
