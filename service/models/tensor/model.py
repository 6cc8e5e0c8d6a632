# Over 500 lines: the tensor kind's batched, padded, lone-session and per-row isolated runs share one state.
"""The tensor kind: any ONNX graph; inputs checked against the graph, batched along axis 0 and padded
along the sequence axis, each request given back its own slice of every output; a graph without a
batch axis (max_batch_size 0) runs each request alone, its outputs whole."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from service.datatypes import InputLimits
from service.errors import Internal, InvalidArgument, ServingError, quote
from service.models.common import (
    Metadata,
    ModelStats,
    Result,
    _as_strings,
    _check_served,
    check_outputs,
    checked_feeds,
    has_batch_axis,
)
from service.models.runtime import TensorRuntime, TensorSpec
from service.models.warmup import graph_feeds
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import WorkItem
from service.scheduling.batching import LONE, DynamicBatcher
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight
from service.scheduling.preferred import PreferredSizes
from service.scheduling.priorities import PriorityChooser
from service.scheduling.tuning import CostModel, Tuning, lone_inline_tokens, lone_threshold, sweep, tune

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["TensorModel"]

log = logging.getLogger("qkv.models")

# The request lengths at which warm-up times the lone session against an instance (tensor models with a
# sequence axis; a model without one is timed at its one shape).
LONE_LENGTHS = (8, 16, 32, 64, 128, 256, 512)
LONE_ROUNDS = 5  # each length timed this many times on an instance and on the lone session, the best kept
# The padding check (TensorModel.check_padding): rows of these lengths alone and padded together, their real
# positions' outputs equal within these tolerances (what batching fp32 rows of different batch sizes moves).
PADDING_LENGTHS = (12, 7, 3)
PADDING_RTOL, PADDING_ATOL = 1e-3, 1e-4


def _outside(ids: np.ndarray, size: int) -> bool:
    """Whether any of the token `ids` lies outside [0, size): one pass for signed integers, whose negatives
    read as unsigned are above any vocabulary's size."""
    bits = 8 * ids.dtype.itemsize
    if ids.dtype.kind == "i" and size < 1 << (bits - 1):
        return bool(ids.view(f"u{ids.dtype.itemsize}").max() >= size)
    return bool(ids.min() < 0 or ids.max() >= size)


def _failed_alone(model: str, error: Exception) -> ServingError:
    """A request onnxruntime failed on, run alone: its inputs are at fault (INVALID_ARGUMENT with onnxruntime's
    message), unless memory ran out (INTERNAL)."""
    message = str(error)
    if isinstance(error, MemoryError) or "allocat" in message.lower():
        return Internal(f"model '{model}' failed on this request: {message}")
    return InvalidArgument(f"model '{model}' cannot run on this request's inputs: {message}")


def _stack(parts: list[np.ndarray], axis: int | None, longest: int) -> np.ndarray:
    """Requests' arrays as one batch, zero-padded along the sequence `axis` (if any) to `longest`.

    One allocation for the batch; a lone request that needs no padding is passed through as is.
    """
    if axis is None:
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
    if len(parts) == 1 and parts[0].shape[axis] == longest:
        return parts[0]
    shape = list(parts[0].shape)
    shape[0], shape[axis] = sum(p.shape[0] for p in parts), longest
    batch = np.zeros(shape, dtype=parts[0].dtype)
    row = 0
    for p in parts:
        index = [slice(None)] * p.ndim
        index[0], index[axis] = slice(row, row + p.shape[0]), slice(0, p.shape[axis])
        batch[tuple(index)] = p
        row += p.shape[0]
    return batch


class TensorModel:
    kind = "tensor"
    platform = "onnxruntime_onnx"
    compute_span = "qkv.compute"

    def __init__(
        self,
        config: ModelConfig,
        runtime: TensorRuntime,
        observer: ModelObserver,
        compute: ComputeThreads | None = None,
    ) -> None:
        self.config, self.runtime, self.observer = config, runtime, observer
        self.name, self.version, self.provider = config.name, config.version, runtime.provider
        self.inputs, self.outputs = runtime.inputs, runtime.outputs
        self.stats = ModelStats()
        self.in_flight = InFlight()  # leases of requests between their lookup and their answer (the server's)
        _check_served(config, self.inputs, self.outputs)
        self.batchable = has_batch_axis(config, [*self.inputs, *self.outputs])
        self.sequence_axis = config.sequence_axis
        self._seq_names = {
            s.axes[self.sequence_axis]
            for s in self.inputs
            if self.sequence_axis is not None and len(s.axes) > self.sequence_axis
        }
        self._seq_names.discard(None)
        self.max_sequence_length = int(config.limits.get("max_sequence_length", 0))
        # input name -> vocabulary size: token ids must lie in [0, size)
        self.vocab_size = {k: int(v) for k, v in (config.limits.get("vocab_size") or {}).items()}
        # input name -> (lowest, highest): every value must lie within
        self.value_range: dict[str, tuple[float, float]] = dict(config.limits.get("value_range") or {})
        # elements of one output, at most, where no input bounds it: what lets it be an ensemble's step
        most = config.limits.get("max_output_elements")
        self.max_output_elements = None if most is None else int(most)
        b = config.batching if self.batchable else replace(config.batching, enabled=False, max_batch_size=1)
        self.max_batch_size = b.max_batch_size if self.batchable else 0
        lone = runtime.lone is not None  # a batch running alone may use every core
        self.batcher = DynamicBatcher(self.name, b, self._run_batch, len(runtime.sessions), observer, lone, compute)
        self.optional = frozenset(d["name"] for d in config.inputs if d.get("optional"))  # Triton's `optional`
        self.priorities = config.priorities  # Triton's priority levels and queue policies, when configured
        if config.preferred_batch_sizes:  # Triton's dynamic_batching.preferred_batch_size
            self.batcher.select = PreferredSizes(config.preferred_batch_sizes, self.batcher.select)
        if self.priorities is not None:
            self.batcher.select = PriorityChooser(self.priorities, self.batcher.select)
        self.admission = self.batcher.admission  # the server refuses early with it, before decoding
        self.tuning: Tuning | None = None  # what warm_up measured and chose
        # warm-up's inputs: varied (from a seed), or plain (None) for a graph that takes no other
        self.feed_seed: int | None = 0
        # Whether requests of different lengths share a batch, padded (check_padding), and why.
        self.pads = True
        self.padding_source = ""

    def warm_up(self, length: int = 64) -> None:
        """Batches on each instance before serving. onnxruntime's first run allocates its arena; padding is
        checked (`check_padding`); a sweep of batch sizes measures what a batch costs here, from which the
        batching settings config.json leaves out are chosen (service/scheduling/tuning.py); and the best run
        gives admission a throughput estimate before any request: without one, a flood on a fresh server
        would be admitted up to the queue limits, seconds of work. The inputs are read from the graph
        (service/models/warmup.py)."""
        if self.max_sequence_length:
            length = min(length, self.max_sequence_length)
        feeds = self._first_runs(length)
        try:
            self.check_padding()
            tokens = self._length(feeds)  # counted as a request's tokens are
            rows = self.max_batch_size if self.batchable else 1
            points = sweep(lambda n: self.batcher.served_seconds(partial(self._batch_of, length, n)), tokens, rows)
        except Exception as e:  # onnxruntime's own exception types: a graph that cannot run is not served
            raise RepositoryError(
                f"model '{self.name}' version {self.version}: warm-up failed ({self._shown(feeds)}): {e}"
            ) from e
        cost = CostModel.fit(points)
        tuning = tune(self.batcher.config, self.config.batching_given, points, self.batcher.handoff_seconds(), cost)
        self.tuning = tuning
        self.batcher.use(tuning, cost)
        log.info("batching %s", tuning.summary(self.name))
        best_tokens, best_seconds = max(points, key=lambda p: p[0] / p[1] if p[1] > 0 else 0.0)
        self.admission.seed(best_tokens, best_seconds)
        if self.batcher.lone:
            self._choose_lone(length)
        self.stats = ModelStats()  # the statistics count requests, not warm-up batches

    def _first_runs(self, length: int) -> dict[str, np.ndarray]:
        """Each session's first run (it allocates its arena), on inputs read from the graph: varied token ids
        and values first, then plain ones (zeros) for a graph that takes no other. The feeds that ran; a
        RepositoryError saying what was fed and what onnxruntime answered when neither did."""
        tried: list[str] = []
        for seed in (0, None):
            self.feed_seed = seed
            feeds = self._feeds(1, length)
            try:
                for instance in [*range(self.batcher.instances), *([LONE] if self.batcher.lone else [])]:
                    self.runtime.run(instance, feeds)
                return feeds
            except Exception as e:  # onnxruntime's own exception types
                tried.append(f"{self._shown(feeds)}: {e}")
        raise RepositoryError(
            f"model '{self.name}' version {self.version}: warm-up failed on inputs read from the graph "
            f"({'; then '.join(tried)})"
        )

    def _shown(self, feeds: dict[str, np.ndarray]) -> str:
        """The warm-up's feeds as a message names them: each input's datatype and shape."""
        by_name = {s.name: s.datatype for s in self.inputs}
        return "inputs " + ", ".join(f"{k} {by_name.get(k, '?')} {list(v.shape)}" for k, v in feeds.items())

    def check_padding(self) -> None:
        """Whether requests of different lengths may share a batch, padded along the sequence axis: config.json
        `batching.padding` "safe" or "unsafe" says so; "check" (the default) runs rows of a few lengths alone
        and padded together in one batch, and compares the real positions' outputs. Where padding changes
        them, the model batches only requests of equal length, and the log says why and how to override."""
        if not self.batchable or not self._seq_names:
            return  # nothing is ever padded
        policy = self.config.batching.padding
        why = ""
        if policy == "check":
            why = "the check could not run: the graph took no inputs but zeros at warm-up"
            if self.feed_seed is not None:  # rows of varied values, which padding's zeros could change
                why = self._padding_changes()
            self.padding_source = f"checked at load: {why}" if why else "checked at load"
        else:
            self.padding_source = "config.json"
        self.pads = policy == "safe" or (policy == "check" and not why)
        if self.pads:
            how = "checked at load: outputs unchanged" if policy == "check" else "trusted (config.json)"
            log.info("model '%s': padding along sequence axis %d %s", self.name, self.sequence_axis, how)
            return
        self.batcher.config = self.admission.config = replace(self.batcher.config, padding="unsafe")
        if policy == "check":
            log.warning(
                "model '%s': padding changes its outputs (%s): requests are batched only with others of equal "
                'length. Give the graph an attention mask input, or set "batching": {"padding": "safe"} in '
                "config.json to pad anyway (the outputs of padded rows then differ from the same request alone)",
                self.name,
                why,
            )
        else:
            log.info('model \'%s\': "padding": "unsafe" (config.json): batched only with requests of equal length',
                     self.name)  # fmt: skip

    def _padding_changes(self) -> str:
        """Rows of PADDING_LENGTHS (within max_sequence_length) run alone and padded in one batch: "" when the
        real positions' outputs agree within PADDING_RTOL and PADDING_ATOL, else what differs."""
        limit = self.max_sequence_length or max(PADDING_LENGTHS)
        lengths = sorted({max(1, min(n, limit)) for n in PADDING_LENGTHS}, reverse=True)
        if len(lengths) < 2:
            return ""  # every request has the one length: nothing is padded
        rows = [self._feeds(1, n, seed=i + 1) for i, n in enumerate(lengths)]
        names = [o.name for o in self.outputs]
        longest = lengths[0]
        feeds = {
            s.name: _stack(
                [r[s.name] for r in rows], self.sequence_axis if self._on_sequence_axis(s) else None, longest
            )
            for s in self.inputs
        }
        try:
            alone = [dict(zip(names, self.runtime.run(0, r), strict=True)) for r in rows]
            batch = dict(zip(names, self.runtime.run(0, feeds), strict=True))
        except Exception as e:  # onnxruntime's own exception types: not shown safe, so not padded
            return f"the check could not run rows of lengths {lengths} alone and padded together: {e}"
        for i, n in enumerate(lengths):
            for o in self.outputs:
                index = [slice(i, i + 1)] + [slice(0, n) if a in self._seq_names else slice(None) for a in o.axes[1:]]
                got, want = batch[o.name][tuple(index)], alone[i][o.name]
                what = f"output {quote(o.name)} of a row of length {n}"
                if got.shape != want.shape:
                    return (
                        f"{what} is {list(got.shape)} in a batch padded to {longest}, {list(want.shape)} alone: "
                        "its length follows the padded length, and no axis of it is named as the sequence axis"
                    )
                if got.dtype.kind not in "fc":
                    if not np.array_equal(got, want):
                        return f"{what} differs in a batch padded to {longest} from the same row alone"
                elif not np.allclose(got, want, rtol=PADDING_RTOL, atol=PADDING_ATOL, equal_nan=True):
                    diff = float(np.nanmax(np.abs(got.astype(np.float64) - want)))
                    return f"{what} differs by up to {diff:.3g} in a batch padded to {longest} from the same row alone"
        return ""

    def _choose_lone(self, length: int) -> None:
        """Where the lone session gains: one request of each length timed on an instance and on it (every
        core). It is kept for the lengths from which it gains, or freed when it gains at none."""
        lengths = [n for n in LONE_LENGTHS if not self.max_sequence_length or n <= self.max_sequence_length]
        points = []
        for n in lengths if self.sequence_axis is not None else [length]:
            feeds = self._feeds(1, n)
            best = {0: float("inf"), LONE: float("inf")}
            for _ in range(LONE_ROUNDS):  # the two taking turns: a moment's slowness is not one side's
                for instance in best:
                    t0 = time.perf_counter()
                    self.runtime.run(instance, feeds)
                    best[instance] = min(best[instance], time.perf_counter() - t0)
            points.append((self._length(feeds), best[0], best[LONE]))
        threshold = lone_threshold(points)
        shown = ", ".join(f"{t}: {a * 1e3:.2f} / {b * 1e3:.2f} ms" for t, a, b in points)
        if threshold is None:
            self.batcher.lone = False
            self.runtime.lone = None  # its sessions' memory goes back
            log.info("model '%s': a request alone gains nothing from every core (instance / lone, by tokens: %s): "
                     "no lone session", self.name, shown)  # fmt: skip
            return
        self.batcher.lone_min_tokens = threshold
        if "inline_max_tokens" not in self.config.batching_given:  # an explicit inline rule is the whole rule
            handoff = self.tuning.handoff_ms / 1e3 if self.tuning else self.batcher.handoff_seconds()
            self.batcher.lone_inline_max_tokens = lone_inline_tokens(points, handoff, threshold)
        inline = self.batcher.lone_inline_max_tokens
        log.info("model '%s': a request alone of %d tokens or more runs on every core%s (instance / lone, by "
                 "tokens: %s)", self.name, threshold, f", up to {inline} on the event loop's thread" if inline else "",
                 shown)  # fmt: skip

    def batching(self) -> BatchingConfig:
        return self.batcher.config

    def batching_sources(self) -> dict[str, str]:
        """Where each tuned setting came from (config.json, or what warm-up measured)."""
        return dict(self.tuning.reasons) if self.tuning is not None else {}

    def config_parameters(self) -> dict[str, str]:
        """What a client needs to make requests the model takes: its sequence axis, longest sequence and
        each token input's vocabulary (`qkv bench --model` reads them), where config.json declares them; and,
        where the model has a sequence axis, whether requests of different lengths are padded into one batch
        ("safe") or batched only with equal lengths ("unsafe"), and why."""
        shown: dict[str, object] = {
            "sequence_axis": self.sequence_axis,
            "max_sequence_length": self.max_sequence_length or None,
        }
        shown |= {f"vocab_size.{name}": size for name, size in self.vocab_size.items()}
        if self.padding_source:
            shown |= {
                "batching.padding": "safe" if self.pads else "unsafe",
                "batching.padding.source": self.padding_source,
            }
        return {key: str(value) for key, value in shown.items() if value is not None}

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Batching begins; `on_failure` hears if the batcher dies (the registry takes the version out)."""
        self.batcher.tracer = tracer
        self.batcher.on_failure = on_failure
        self.batcher.start()

    async def close(self) -> None:
        """Take no new requests; return once the queued and running ones are answered."""
        await self.batcher.close()

    def release(self) -> None:
        """Free the sessions (after `close`): their memory goes when the last reference does."""
        self.runtime.sessions.clear()

    def _feeds(self, rows: int, length: int, seed: int | None = None) -> dict[str, np.ndarray]:
        """Warm-up inputs read from the graph (service/models/warmup.py): `seed`, or the one warm-up chose."""
        chosen = self.feed_seed if seed is None or self.feed_seed is None else seed
        return graph_feeds(self.inputs, rows, length, self.batchable, self._seq_names, self.vocab_size, chosen)

    def _batch_of(self, length: int, rows: int) -> None:
        """One batch of `rows` one-row requests through the batch step (stacking, onnxruntime, splitting)."""
        one = self._feeds(1, length)
        names = [o.name for o in self.outputs]
        unused = cast("asyncio.Future[Any]", None)  # the batch step reads payloads only
        item = partial(WorkItem, rows=1, length=self._length(one), payload=(one, names, self._group(one)))
        for result in self._run_batch([item(future=unused) for _ in range(rows)], 0):
            if isinstance(result, ServingError):
                raise result  # the warm-up's own inputs: the graph cannot run batches

    def _length(self, feeds: dict[str, np.ndarray]) -> int:
        """A request's length: along the sequence axis; 1 without one, so that its tokens are its rows (1
        without a batch axis). Requests without a sequence axis batch only with others of the same shape, so
        nothing is padded, and what a row costs is measured at warm-up: the tuned settings and admission's
        throughput are in rows, and an image is one token, not its 150,528 elements (docs/configuration.md)."""
        if self.sequence_axis is None:
            return 1
        lengths = {
            feeds[s.name].shape[self.sequence_axis]
            for s in self.inputs
            if s.name in feeds and self._on_sequence_axis(s)
        }
        if len(lengths) > 1:
            raise InvalidArgument(
                f"inputs disagree on the sequence length (axis {self.sequence_axis}): {sorted(lengths)}"
            )
        return lengths.pop() if lengths else 1

    def _row_elements(self, feeds: dict[str, np.ndarray]) -> int:
        """The most elements one row of an input holds (the whole tensor without a batch axis)."""
        return max((math.prod(a.shape[1:] if self.batchable else a.shape) for a in feeds.values()), default=1)

    def _on_sequence_axis(self, s: TensorSpec) -> bool:
        axis = self.sequence_axis
        return axis is not None and len(s.axes) > axis and s.axes[axis] in self._seq_names

    def input_limits(self, name: str) -> InputLimits:
        """What input `name` may hold, checked before it is decoded."""
        return InputLimits()

    def _group(self, feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
        """Requests batch together when all their dims but batch (and sequence, when padding is safe) agree."""
        key = []
        for s in self.inputs:
            if s.name not in feeds:  # an optional input left out: batched with requests that left it out too
                continue
            dims = list(feeds[s.name].shape[1:])
            if self.sequence_axis is not None and self.pads and self._on_sequence_axis(s):
                dims[self.sequence_axis - 1] = -1
            key.append((s.name, tuple(dims)))
        return tuple(key)

    def _checked_limits(self, feeds: dict[str, np.ndarray]) -> int:
        """The request's sequence length, after config.json's limits: INVALID_ARGUMENT naming the input when
        a sequence is empty or too long, or a token id lies outside its vocabulary."""
        for s in self.inputs:
            # An empty tensor (a 0 in a dimension of the model's own) is served, as onnxruntime and Triton serve
            # it; an empty sequence is not: a sequence model (attention over no position) has no answer for it.
            if s.name not in feeds:
                continue
            empty = feeds[s.name]
            if empty.size == 0 and self._on_sequence_axis(s) and empty.shape[self.sequence_axis] == 0:  # type: ignore[index]
                raise InvalidArgument(f"input '{s.name}': shape {list(empty.shape)} has no elements: nothing to infer")
        length = self._length(feeds)
        if self.max_sequence_length:
            # Without a sequence axis, max_sequence_length bounds the elements of one row.
            longest = length if self.sequence_axis is not None else self._row_elements(feeds)
            if longest > self.max_sequence_length:
                raise InvalidArgument(
                    f"sequence length {longest} exceeds model '{self.name}' limit of {self.max_sequence_length}"
                )
        for name, size in self.vocab_size.items():
            a = feeds.get(name)
            if a is not None and a.size and _outside(a, size):
                bad = int(a.min()) if a.min() < 0 else int(a.max())
                raise InvalidArgument(f"input '{name}': token id {bad} outside the vocabulary [0, {size})")
        for name, (low, high) in self.value_range.items():
            a = feeds.get(name)
            if a is None or not a.size or a.dtype.kind not in "biuf":
                continue
            smallest, largest = a.min(), a.max()
            if smallest < low or largest > high:
                bad = smallest if smallest < low else largest
                raise InvalidArgument(
                    f"input '{name}': value {bad:g} outside the range [{low:g}, {high:g}] of limits.value_range"
                )
        return length

    @cached_property
    def metadata(self) -> Metadata:
        """What the version is (ModelMetadata, ModelConfig): fixed once it is loaded."""
        return Metadata(
            self.kind, self.platform, self.provider, self.max_batch_size, self.inputs, self.outputs, self.compute_span
        )

    def admit_early(self, deadline: float | None) -> None:
        """Refused before its tensors are decoded when the queue cannot take it by `deadline`."""
        self.admission.check(0, deadline)

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result:
        feeds = checked_feeds(self.inputs, inputs, self.name, self.optional)
        if not feeds:
            raise InvalidArgument(f"model '{self.name}': the request gives none of its inputs")
        names = [o.name for o in self.outputs]
        check_outputs(names, outputs, self.name)
        rows = {a.shape[0] for a in feeds.values()} if self.batchable else {1}
        if len(rows) > 1:
            raise InvalidArgument(f"inputs disagree on the batch size (axis 0): {sorted(rows)}")
        n = rows.pop()
        if n < 1:
            raise InvalidArgument("the batch dimension (axis 0) is 0: nothing to infer")
        if self.batchable and n > self.max_batch_size:
            raise InvalidArgument(f"batch of {n} exceeds model '{self.name}' max_batch_size {self.max_batch_size}")
        length = self._checked_limits(feeds)
        feeds = {
            s.name: _as_strings(feeds[s.name], s.name, self.name) if s.datatype == "BYTES" else feeds[s.name]
            for s in self.inputs
            if s.name in feeds
        }
        loop = asyncio.get_running_loop()
        item = WorkItem(
            rows=n,
            length=length,
            payload=(feeds, outputs or names, self._group(feeds)),
            future=loop.create_future(),
            deadline=deadline,
            trace=trace,
        )
        if self.priorities is not None:
            self.priorities.admit(item, params, self.batcher.queue)
        result: dict[str, np.ndarray] = await self.batcher.submit(item)
        self.stats.account_request(item)
        tokens = n * length
        # No sequence axis: no length to tell requests apart by (they batch only with equal shapes), so none
        # is reported, rather than the 1 they are counted by (docs/design.md, "Metrics": `seq_len`).
        return Result(result, length if self.sequence_axis is not None else 0, tokens, 0)

    def _run_batch(self, items: list[WorkItem], instance: int) -> list[dict[str, np.ndarray] | ServingError]:
        """Runs on an instance thread: pad, concatenate, run once, split back per request (a request that fails
        gets its error, the others their answers)."""
        groups: dict[Any, list[int]] = {}
        for i, x in enumerate(items):
            groups.setdefault(x.payload[2], []).append(i)
        results: list[dict[str, np.ndarray] | ServingError] = [{} for _ in items]
        for index in groups.values():
            part = [items[i] for i in index]
            for i, r in zip(index, self._run_group(part, instance), strict=True):
                results[i] = r
        return results

    def _run_group(self, items: list[WorkItem], instance: int) -> list[dict[str, np.ndarray] | ServingError]:
        """The group's answers; a request that onnxruntime fails on gets its error, the others their answers."""
        if not self.batchable:  # no batch axis: nothing to stack or cut, each request is a batch of its own
            return [self._isolated([x], instance, self._run_alone)[0] for x in items]
        return self._isolated(items, instance, self._run_stacked)

    def _isolated(
        self, items: list[WorkItem], instance: int, run: Callable[[list[WorkItem], int], list[dict[str, np.ndarray]]]
    ) -> list[dict[str, np.ndarray] | ServingError]:
        """`run(items, instance)`; where onnxruntime fails on the batch, its halves run apart, and theirs, down
        to the request(s) that fail alone: those get INVALID_ARGUMENT with onnxruntime's message (the model ran
        at warm-up, and its batch-mates run: the fault is in the request's inputs), the others their answers.
        One bad request among n costs some 2 log2(n) more runs, once."""
        try:
            return cast("list[dict[str, np.ndarray] | ServingError]", run(items, instance))
        except ServingError as e:
            return [e] * len(items)
        except Exception as e:  # onnxruntime's own exception types
            if len(items) == 1:
                self.observer.computation_failed("request")
                log.warning("model '%s': a request failed alone: %s", self.name, e)
                return [_failed_alone(self.name, e)]
            self.observer.computation_failed("batch")
            log.warning("model '%s': a batch of %d requests failed (%s): retried in halves", self.name, len(items), e)
            half = len(items) // 2
            return [*self._isolated(items[:half], instance, run), *self._isolated(items[half:], instance, run)]

    def _run_stacked(self, items: list[WorkItem], instance: int) -> list[dict[str, np.ndarray]]:
        """The group's requests stacked into one batch (padded along the sequence axis), run once, cut back."""
        t0 = time.perf_counter_ns()
        longest = max(x.length for x in items)
        feeds = {}
        for s in self.inputs:
            if s.name not in items[0].payload[0]:  # an optional input the group's requests left out
                continue
            axis = self.sequence_axis if self._on_sequence_axis(s) else None
            feeds[s.name] = _stack([x.payload[0][s.name] for x in items], axis, longest)
        wanted = sorted({o for x in items for o in x.payload[1]}, key=[o.name for o in self.outputs].index)
        arrays = dict(zip(wanted, self.runtime.run(instance, feeds, wanted), strict=True))
        out: list[dict[str, np.ndarray]] = []
        start = 0
        for x in items:
            mine = {}
            for o in self.outputs:
                if o.name not in x.payload[1]:
                    continue
                # This request's rows, cut back to its own length: a view, copied only when cut.
                index = [slice(start, start + x.rows)]
                index += [slice(0, x.length) if sym in self._seq_names else slice(None) for sym in o.axes[1:]]
                mine[o.name] = np.ascontiguousarray(arrays[o.name][tuple(index)])
            out.append(mine)
            start += x.rows
        self.stats.executed(sum(x.rows for x in items), time.perf_counter_ns() - t0)
        return out

    def _run_alone(self, items: list[WorkItem], instance: int) -> list[dict[str, np.ndarray]]:
        """One request (`items` holds one) run as it came, without a batch axis."""
        (item,) = items
        t0 = time.perf_counter_ns()
        wanted = [o.name for o in self.outputs if o.name in item.payload[1]]
        arrays = self.runtime.run(instance, item.payload[0], wanted)
        self.stats.executed(1, time.perf_counter_ns() - t0)
        return [dict(zip(wanted, arrays, strict=True))]
