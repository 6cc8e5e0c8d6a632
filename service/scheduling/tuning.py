"""Batching settings from a tensor model's measured cost on this machine (docs/configuration.md, "Tuned
batching").

A batch's time as served (from the event loop to an instance's thread and back) is modelled as
`fixed + per_token x padded tokens`, fitted to a sweep of batch sizes run at start and refitted to the
batches served. With the measured cost of the hand-off alone, it decides what config.json leaves unsaid:

- `inline_max_tokens`: a request on an idle server is computed on the event loop's own thread when its
  predicted time is at most INLINE_HANDOFFS times the cost of handing it to an instance's thread, and
  only while requests come one at a time (`Pacing.alone`): then the hand-off, and waking an idle core,
  are what a lone request would wait for, and nobody waits behind it. Under concurrent load a request
  computed inline holds up the ones arriving meanwhile, which then find the server idle in turn and run
  one at a time, unbatched: the fixed 32-token rule did that (seq 16, c32: 0.2 of the ceiling);
- `token_budget`: the fewest padded tokens at which a batch's measured throughput (as served, from the
  sweep) reaches 97 % of the best the sweep measured: larger batches add latency, and past a point
  they lose throughput too, their activations no longer in the caches;
- `max_queue_delay_ms`: one batch's fixed cost, the most that waiting for one more request can save; and
  a partial batch waits at all only while requests arrive faster than that (`Pacing`).

Values given in config.json win. The server logs what it chose and why; ModelConfig and the
`qkv_batching_setting` metric show the values in force.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from typing import Any

from service.scheduling.config import BatchingConfig

__all__ = [
    "QUIET_ARRIVALS",
    "TUNED",
    "CostModel",
    "Pacing",
    "Tuning",
    "handoff_seconds",
    "served_seconds",
    "sweep",
    "tune",
]

TUNED = ("inline_max_tokens", "token_budget", "max_queue_delay_ms")
PEAK_SHARE = 0.97  # the budget: the fewest tokens at which the sweep's throughput reaches this share of its best
INLINE_HANDOFFS = 20  # computed on the event loop: a request that costs at most this many hand-offs
QUIET_ARRIVALS = 8  # ... and only after this many requests in a row have come one at a time
SWEEP_LIMIT_S = 0.25  # a sweep stops growing batches once one takes this long
SWEEP_RUNS = 3  # each batch size of the sweep is timed this many times, in turns, the best kept
REFIT_EVERY = 32  # served batches between refits


@dataclass
class CostModel:
    """Seconds of one batch = fixed + per_token x padded tokens, least squares over measured batches."""

    fixed: float
    per_token: float
    samples: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=256))
    _since_fit: int = 0

    @classmethod
    def fit(cls, points: Iterable[tuple[int, float]]) -> CostModel:
        model = cls(0.0, 0.0)
        model.samples.extend(points)
        model._refit()
        return model

    def predict(self, tokens: int) -> float:
        return self.fixed + self.per_token * tokens

    def observe(self, tokens: int, seconds: float) -> None:
        """A served batch: the model follows the machine (load, caches, frequency) as it serves."""
        self.samples.append((tokens, seconds))
        self._since_fit += 1
        if self._since_fit >= REFIT_EVERY:
            self._refit()

    def _refit(self) -> None:
        """Weighted least squares with weights 1/seconds^2 (relative errors): the samples span three orders
        of magnitude, and the fixed cost, which small batches show, must not drown in the large ones'."""
        self._since_fit = 0
        points = [(float(t), s) for t, s in self.samples if s > 0]
        if not points:
            return
        w = [1.0 / (s * s) for _, s in points]
        sw = sum(w)
        mx = sum(wi * x for wi, (x, _) in zip(w, points, strict=True)) / sw
        my = sum(wi * y for wi, (_, y) in zip(w, points, strict=True)) / sw
        var = sum(wi * (x - mx) ** 2 for wi, (x, _) in zip(w, points, strict=True))
        cov = sum(wi * (x - mx) * (y - my) for wi, (x, y) in zip(w, points, strict=True))
        if var <= 0:  # one size only: nothing tells fixed from per-token time, so all of it is per token
            self.per_token, self.fixed = (my / mx if mx > 0 else 0.0), 0.0
            return
        slope = cov / var
        if slope <= 0:  # no growth with tokens across sizes: the fit with slope >= 0 is a fixed cost, the mean
            self.per_token, self.fixed = 0.0, my
            return
        self.per_token = slope
        self.fixed = max(0.0, my - slope * mx)


def sweep(run: Callable[[int], float], length: int, max_rows: int) -> list[tuple[int, float]]:
    """(padded tokens, best seconds of SWEEP_RUNS runs) for 1, 2, 4 ... max_rows rows of `length`; stops early
    once a batch takes SWEEP_LIMIT_S (a large model's full sweep would hold the start for seconds). The sizes
    are timed in turns, a run of each per round: a slow moment of a shared machine then slows one run of
    several sizes, not every run of one (which moved the budget between 256 and 1,024 tokens)."""
    best: dict[int, float] = {}
    rows = 1
    while True:  # the first round finds the sizes
        best[rows] = run(rows)
        if best[rows] > SWEEP_LIMIT_S or rows == max_rows:
            break
        rows = min(rows * 2, max_rows)
    for _ in range(SWEEP_RUNS - 1):
        for rows in best:
            best[rows] = min(best[rows], run(rows))
    return [(rows * length, seconds) for rows, seconds in best.items()]


LONE_GAIN = 0.9  # the lone session is used where it takes at most this share of an instance's time


def lone_threshold(points: list[tuple[int, float, float]]) -> int | None:
    """The fewest tokens from which a batch running alone is faster on the lone session (every core) than on
    an instance: the smallest measured size from which every larger one took at most LONE_GAIN of an
    instance's time (`points`: tokens, an instance's seconds, the lone session's seconds). None when no size
    gains: a small model loses more to waking threads than it wins from them."""
    threshold = None
    for tokens, instance, lone in sorted(points, reverse=True):
        if lone > LONE_GAIN * instance:
            break
        threshold = tokens
    return threshold


def lone_inline_tokens(points: list[tuple[int, float, float]], handoff: float, threshold: int) -> int:
    """The most tokens a request alone on an idle server may have to run on the lone session from the event
    loop's own thread: the largest measured size, from `threshold` up, whose lone time (`points`' third) and
    every smaller one's is at most INLINE_HANDOFFS hand-offs, the bound an instance's inline requests keep."""
    tokens = 0
    for size, _, lone in sorted(points):
        if size < threshold:
            continue
        if lone > INLINE_HANDOFFS * handoff:
            break
        tokens = size
    return tokens


def served_seconds(executor: Executor, batch: Callable[[], object], pause: float = 0.002) -> float:
    """Seconds for an event loop to have `batch` run on an instance's thread and get its result back, after
    a pause (so the threads have gone to sleep, as between requests): a batch's cost as served, not as
    onnxruntime alone sees it. Measured on a loop of its own, in a thread of its own."""

    async def measure() -> float:
        await asyncio.sleep(pause)
        t0 = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(executor, batch)
        return time.perf_counter() - t0

    result: list[float] = []
    thread = threading.Thread(target=lambda: result.append(asyncio.run(measure())))
    thread.start()
    thread.join()
    return result[0]


def handoff_seconds(executor: Executor, n: int = 15) -> float:
    """Median cost of handing nothing to an instance's thread and back: what computing a request on the
    event loop itself saves."""
    return sorted(served_seconds(executor, _nothing) for _ in range(n))[n // 2]


def _nothing() -> None: ...


@dataclass(frozen=True)
class Tuning:
    """What the measurements gave, and the settings in force (config.json's where it gave them)."""

    config: BatchingConfig
    fixed_ms: float
    per_token_us: float
    handoff_ms: float
    reasons: dict[str, str]
    given: frozenset[str]  # the keys config.json set

    def summary(self, model: str) -> str:
        said = "; ".join(f"{k} {getattr(self.config, k):g} ({why})" for k, why in self.reasons.items())
        return (
            f"model '{model}': a batch costs {self.fixed_ms:.3f} ms + {self.per_token_us:.3f} us/token, a hand-off "
            f"{self.handoff_ms:.3f} ms: {said}"
        )


def tune(
    config: BatchingConfig, given: frozenset[str], points: list[tuple[int, float]], handoff: float, cost: CostModel
) -> Tuning:
    """The settings for a model whose sweep gave `points` and whose hand-off costs `handoff` seconds."""
    changes: dict[str, Any] = {}
    reasons: dict[str, str] = {}
    if "inline_max_tokens" not in given:
        # computed on the loop, a request costs its served cost less the hand-off
        room = INLINE_HANDOFFS * handoff - (cost.fixed - handoff)
        if room <= 0:
            tokens = 0
        elif cost.per_token > 0:
            tokens = int(room / cost.per_token)
        else:  # a cost that does not grow with tokens: every size the sweep measured fits
            tokens = max((t for t, _ in points), default=0)
        changes["inline_max_tokens"] = tokens
        reasons["inline_max_tokens"] = (
            f"requests computing in at most {INLINE_HANDOFFS} hand-offs, while requests come one at a time"
        )
    rates = [(tokens / seconds, tokens) for tokens, seconds in points if seconds > 0]
    if "token_budget" not in given and rates:
        # Measured, not modelled: past a point larger batches get slower per token (their activations
        # leave the caches), which no fixed + per-token model shows.
        best = max(rate for rate, _ in rates)
        changes["token_budget"] = min(tokens for rate, tokens in rates if rate >= PEAK_SHARE * best)
        reasons["token_budget"] = (
            f"the fewest tokens at which a batch's throughput is {PEAK_SHARE:.0%} of the best measured"
        )
    if "max_queue_delay_ms" not in given:
        changes["max_queue_delay_ms"] = round(cost.fixed * 1e3, 3)
        reasons["max_queue_delay_ms"] = "one batch's fixed cost, the most one more request saves"
    for key in TUNED:
        if key in given:
            reasons[key] = "config.json"
    return Tuning(replace(config, **changes), cost.fixed * 1e3, cost.per_token * 1e6, handoff * 1e3, reasons, given)


class Pacing:
    """What the arrivals say. When a partial batch should wait for company: only while requests arrive
    faster than one batch's fixed cost, which is what batching one more request saves. And, with an
    `overlap` gap, whether requests come one at a time, so that one computed on the event loop keeps
    nobody waiting (`alone`)."""

    def __init__(self, cost: CostModel | None, overlap: float | None = None) -> None:
        self.cost = cost
        self.interarrival = math.inf  # seconds, smoothed
        self._last = 0.0
        self.overlap = overlap  # an arrival this soon after an inline computation ended waited behind it
        self._alone = 0  # arrivals in a row that found the server idle and did not wait behind an inline one
        self._inline_end = -math.inf
        self._behind = False  # the latest arrival waited behind an inline computation (the loop never idled)

    def arrived(self, now: float, busy: bool = False, loop_idle: float | None = None) -> None:
        """A request arrived at `now`; `busy`: others were queued or computing; `loop_idle`: when the event
        loop last waited for work (service/scheduling/loop_idle.py; None: not known). A request reached
        without the loop having waited since an inline computation ended had been waiting behind it."""
        if self._last:
            gap = now - self._last
            self.interarrival = gap if math.isinf(self.interarrival) else 0.8 * self.interarrival + 0.2 * gap
        self._last = now
        self._behind = loop_idle is not None and loop_idle < self._inline_end
        overlapped = busy or self._behind or (self.overlap is not None and now - self._inline_end < self.overlap)
        self._alone = 0 if overlapped else self._alone + 1

    def inlined(self, end: float) -> None:
        """A request computed on the event loop finished at `end`."""
        self._inline_end = end

    def alone(self) -> bool:
        """The last QUIET_ARRIVALS requests, the latest included, came one at a time (without an `overlap`
        gap, the rule is then the configured token count alone: only the latest, and only by the loop)."""
        return not self._behind and (self.overlap is None or self._alone >= QUIET_ARRIVALS)

    def company_soon(self) -> bool:
        return self.cost is None or self.interarrival < self.cost.fixed
