"""The text kind's batching settings, from its measured cost (docs/text-models.md, "Batching").

The tensor kind's sweep times batches of 1, 2, 4 ... rows of the warm-up's 64 tokens and fits a batch's
time as `fixed + per_token x padded tokens` (service/scheduling/tuning.py). An encoder on CPU costs about
the same per row of 64 tokens at any batch size, so that sweep shows no fixed cost: all-MiniLM-L6-v2 fitted
"0.000 ms + 331.8 us/token", which made the queue delay 0 and left the tensor kind's default `max_padding`
of 0.1 in force. Texts are short and of every length: under c32, twenty-word texts of 25 to 35 tokens
were taken three to a batch from a queue of thirty, the others too far from the oldest in length to share
10 % of padding. A batch's own cost shows where rows are short: the text kind also times, as served and
in turns, one row and SHORT_ROWS rows of SHORT_LENGTH tokens, and one row of SENTENCE_TOKENS (`ShortRows`).
What one batch fewer saves is the first less what a row adds to a batch; what a padded token costs is
the difference of the two single rows a token. With that as the cost model's fixed cost:

- `max_queue_delay_ms` follows the tensor kind's rule (`tune`), and so does `inline_max_tokens` where it
  allows more than the text kind's rule (below);
- `max_padding` is the padded share whose compute equals one batch's fixed cost, for a sentence of
  SENTENCE_TOKENS tokens: `fixed / (per_token x SENTENCE_TOKENS)`, within PADDING_SHARES. Run apart, two
  texts pay one more batch; run together, the shorter one's padding: padding is worth it up to that. The
  share matters for short texts (a batch of long ones reaches the token budget in a few rows), so it is
  that of a short text's batch. Both costs come from the same turns: the sweep's per-token cost, timed
  seconds earlier, moved the share between 0.1 and 0.5 on a busy machine;
- `token_budget` holds at least MIN_BATCH_ROWS texts of the warm-up's length (the sweep's rule alone,
  the fewest tokens within 97 % of the best throughput, chose one row of 64 tokens).

A request alone on an idle server, while requests come one at a time, is handed to an instance's thread
and back (or, from `lone_min_tokens` on, to the lone session's: every core); the tensor kind computes it on
the event loop's own thread only where its time is within 20 hand-offs (some 2 to 3 ms), which no text of
a sentence's length is on an encoder like all-MiniLM-L6-v2. Handed off, a request pays two thread
wake-ups (the instance's thread, then the event loop's, with the result) and computes at the compute
threads' lower priority, pinned to one core, where anything else running on that core comes first. The
text kind computes such a request on the event loop's thread where it takes at most INLINE_SECONDS, the
longest a request to another model, arriving meanwhile, waits for the event loop: `inline_max_tokens` is
the longer of the short rows (one of SHORT_LENGTH and one of SENTENCE_TOKENS tokens, as served on an
instance) within it, and the lone session's own bound the longest of INLINE_LENGTHS whose lone run
(`lone_times`) is (`inline_tokens`). A request that arrives while one is computed there ends the
one-at-a-time pacing, so a burst is queued and batched as before.

Values given in config.json win, as for the tensor kind (an `inline_max_tokens` given is the whole inline
rule).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from service.scheduling.tuning import CostModel, Tuning, tune

__all__ = [
    "INLINE_LENGTHS",
    "INLINE_SECONDS",
    "MIN_BATCH_ROWS",
    "PADDING_SHARES",
    "SENTENCE_TOKENS",
    "SHORT_LENGTH",
    "SHORT_ROWS",
    "SHORT_RUNS",
    "ShortRows",
    "inline_tokens",
    "lone_times",
    "padding_share",
    "short_rows",
    "text_tuning",
]

SHORT_LENGTH = 16  # tokens of the rows timed for a batch's own cost
SHORT_ROWS = 4  # ... one row, and this many
MIN_BATCH_ROWS = 8  # a tuned token budget holds at least this many texts of the warm-up's length
SENTENCE_TOKENS = 32  # a twenty-word sentence's tokens: the text whose batches max_padding is chosen for
PADDING_SHARES = (0.1, 0.5)  # max_padding's bounds: the tensor kind's default, and half of a batch padding
# Each short size is timed this many times, in turns, the best kept: the share is a ratio of small differences
# of them, which 3 runs left to a busy machine's moments (0.11 where 7 gave 0.27, minutes apart).
SHORT_RUNS = 7
# The lengths of a lone request timed for the inline rule (a query, a sentence, two), and the longest a lone
# request may hold the event loop: 10 ms. all-MiniLM-L6-v2's 20-word text (34 tokens) took 6.2 ms alone on an
# idle 2-core machine (BENCHMARKS.md, "Text models"); on a busy one, warm-up timed its 32-token row at 5.9 to
# 10.3 ms on every core.
INLINE_LENGTHS = (8, 16, SENTENCE_TOKENS, 2 * SENTENCE_TOKENS)
INLINE_SECONDS = 0.010


@dataclass(frozen=True)
class ShortRows:
    """Seconds, as served, of one row of SHORT_LENGTH tokens, SHORT_ROWS such rows, and one row of
    SENTENCE_TOKENS: timed in the same turns, so that their ratios hold on a machine whose speed drifts."""

    one: float
    many: float
    sentence: float

    def fixed(self) -> float:
        """What one batch fewer saves: a batch of one row less what a row adds to a batch."""
        return max(0.0, self.one - (self.many - self.one) / (SHORT_ROWS - 1))

    def per_token(self) -> float:
        """What one more token of a row costs: what padding a row costs, a token at a time."""
        return max(0.0, (self.sentence - self.one) / (SENTENCE_TOKENS - SHORT_LENGTH))


def short_rows(run: Callable[[int, int], float]) -> ShortRows:
    """The best of SHORT_RUNS of each size (`run(length, rows)`), timed in turns as the sweep's sizes are."""
    sizes = [(SHORT_LENGTH, 1), (SHORT_LENGTH, SHORT_ROWS), (SENTENCE_TOKENS, 1)]
    best = dict.fromkeys(sizes, float("inf"))
    for _ in range(SHORT_RUNS):
        for length, rows in sizes:
            best[length, rows] = min(best[length, rows], run(length, rows))
    return ShortRows(*(best[s] for s in sizes))


def lone_times(
    run: Callable[[int], float], lengths: tuple[int, ...] = INLINE_LENGTHS, bound: float = INLINE_SECONDS
) -> list[tuple[int, float]]:
    """(tokens, the best of SHORT_RUNS seconds) of one request of each of `lengths` on the lone session
    (`run(length)`), the lengths timed in turns; the first round stops at the first length over `bound`, the
    longest `inline_tokens` reads (a large model's longer rows would only add to its start). A length is over
    the bound only when every one of SHORT_RUNS runs is: a first run can be cold (all-MiniLM-L6-v2's 8 tokens
    took over 10 ms once, then 3 ms), and one cold run stopped the timing short of the 20-word text's 34."""
    best: dict[int, float] = {}
    for length in lengths:
        best[length] = run(length)
        for _ in range(SHORT_RUNS - 1):
            if best[length] <= bound:
                break
            best[length] = min(best[length], run(length))
        if best[length] > bound:
            break
    for _ in range(SHORT_RUNS - 1):
        for length in best:
            best[length] = min(best[length], run(length))
    return list(best.items())


def inline_tokens(times: list[tuple[int, float]], threshold: int, bound: float = INLINE_SECONDS) -> int:
    """The most tokens of a request computed on the event loop's thread: from `threshold` (the fewest tokens
    the session takes) up, the timed lengths whose time and every shorter one's is at most `bound`, and past
    the longest of them, up to where the time reaches `bound` on the line to the next length; 0 when none
    is within it."""
    tokens, last = 0, None
    for length, seconds in sorted(times):
        if length < threshold:
            continue
        if seconds > bound:
            if last is not None and seconds > last[1]:  # the line from the last length within the bound
                tokens = last[0] + int((length - last[0]) * (bound - last[1]) / (seconds - last[1]))
            break
        tokens, last = length, (length, seconds)
    return tokens


def padding_share(short: ShortRows) -> float:
    """The padded share of a batch of SENTENCE_TOKENS-token texts whose compute is one batch's fixed cost."""
    low, high = PADDING_SHARES
    if short.per_token() <= 0:
        return high  # padding costs nothing measurable
    return round(min(max(short.fixed() / (short.per_token() * SENTENCE_TOKENS), low), high), 3)


def text_tuning(tuning: Tuning, cost: CostModel, short: ShortRows, length: int) -> Tuning:
    """The settings over `tuning` (the sweep's) for a warm-up of `length` tokens, once `cost` (the sweep's fit)
    takes the short rows' fixed cost where it is more than the fit's (`cost` is changed here)."""
    cost.fixed = max(cost.fixed, short.fixed())
    given = tuning.given
    tuned = tune(tuning.config, given, list(cost.samples), tuning.handoff_ms / 1e3, cost)
    changes: dict[str, Any] = {}
    reasons = dict(tuned.reasons)
    floor = MIN_BATCH_ROWS * length
    if "token_budget" not in given and tuned.config.token_budget < floor:
        changes["token_budget"] = floor
        reasons["token_budget"] = f"at least {MIN_BATCH_ROWS} texts of {length} tokens"
    if "inline_max_tokens" not in given:
        timed = [(SHORT_LENGTH, short.one), (SENTENCE_TOKENS, short.sentence)]  # on an instance, as served
        tokens = inline_tokens(timed, 0)
        if tokens > tuned.config.inline_max_tokens:
            changes["inline_max_tokens"] = tokens
            reasons["inline_max_tokens"] = (
                f"a text alone computing in at most {INLINE_SECONDS * 1e3:g} ms, while requests come one at a time"
            )
    if "max_padding" in given:
        reasons["max_padding"] = "config.json"
    else:
        changes["max_padding"] = padding_share(short)
        reasons["max_padding"] = f"padding that computes in one batch's fixed cost, texts of {SENTENCE_TOKENS} tokens"
    return replace(tuned, config=replace(tuned.config, **changes), reasons=reasons)
