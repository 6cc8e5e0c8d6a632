# Over 500 lines: the tensor and g2p kinds and their shared checks, until each kind is a package.
"""The two model kinds, protocol-free: numpy arrays in, numpy arrays out, through a batcher.

- `TensorModel`: any ONNX graph; inputs checked against the graph, batched along axis 0 and
  padded along the sequence axis, each request given back its own slice of every output; a graph
  without a batch axis (max_batch_size 0) runs each request alone, its outputs whole.
- `G2PModel`: TEXT -> PHONEMES (and ATTENTION, WORDS, REASONS, SOURCES, VARIANTS on request): text read
  into words by service/models/g2p_text.py; each word a pronouncing lexicon holds answered from it
  (service/models/lexicon.py), each other one decoded on the shared continuous batch.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import unicodedata
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar, cast

import numpy as np

from service.datatypes import NUMPY_DTYPES, ONNX_UNSERVED, UNSERVED, InputLimits, datatype_of
from service.errors import Internal, InvalidArgument, ServingError, quote
from service.models.g2p_text import RULES, SILENT_ASCII, SILENT_WIDE, VERSIONS, Known, is_symbol, spoken_words
from service.models.lexicon import Lexicon
from service.models.response_cache import ResponseCache, deep_size
from service.models.response_cache import key as cache_key
from service.models.runtime import G2PRuntime, TensorRuntime, TensorSpec
from service.models.warmup import graph_feeds
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import WorkItem
from service.scheduling.batching import LONE, DynamicBatcher
from service.scheduling.config import BatchingConfig
from service.scheduling.continuous import GenerationScheduler, WordsRequest
from service.scheduling.leases import InFlight
from service.scheduling.preferred import PreferredSizes
from service.scheduling.priorities import PriorityChooser
from service.scheduling.tuning import CostModel, Tuning, lone_inline_tokens, lone_threshold, sweep, tune
from service.seq2seq.generation import Hypothesis, greedy_decode
from service.seq2seq.vocab import SPECIALS

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = [
    "G2PModel",
    "ModelStats",
    "Result",
    "TensorModel",
    "check_inputs",
    "check_outputs",
    "checked_feeds",
    "has_batch_axis",
]

log = logging.getLogger("qkv.models")

MAX_REQUEST_ELEMENTS = 1 << 24  # elements of one input tensor, before any per-model limit
# A g2p request with more text than this is read into words on a worker thread (the text rules take up
# to some 3 us a byte: a few KiB are read on the event loop in well under the time of a decoding step).
THREAD_TEXT_BYTES = 1 << 12
# Words a g2p request's text may read as, per word written (max_words): "$3.50" is four, "1999" three.
SPOKEN_PER_WORD = 4
# The request lengths at which warm-up times the lone session against an instance (tensor models with a
# sequence axis; a model without one is timed at its one shape).
LONE_LENGTHS = (8, 16, 32, 64, 128, 256, 512)
LONE_ROUNDS = 5  # each length timed this many times on an instance and on the lone session, the best kept
# The padding check (TensorModel.check_padding): rows of these lengths alone and padded together, their real
# positions' outputs equal within these tolerances (what batching fp32 rows of different batch sizes moves).
PADDING_LENGTHS = (12, 7, 3)
PADDING_RTOL, PADDING_ATOL = 1e-3, 1e-4


@dataclass
class Result:
    outputs: dict[str, np.ndarray]
    seq_len: int  # what the latency histogram is split by; 0: no length, no seq_len label
    tokens_in: int
    tokens_out: int


@dataclass
class ModelStats:
    """Per-model counts and times for Triton's ModelStatistics (nanoseconds).

    Updated from every instance thread and from the event loop at once: each update takes the lock (an
    uncontended one costs little next to a batch), and readers take a `snapshot`, consistent as a whole."""

    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    queue_ns: int = 0
    compute_ns: int = 0
    inference_count: int = 0  # rows
    execution_count: int = 0  # batch runs
    last_inference_ms: int = 0
    batches: dict[int, list[int]] = field(default_factory=dict)  # batch size -> [count, compute ns]
    request_compute_ns: int = 0  # summed over requests: each counts its whole batch, as Triton does
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def account_request(self, item: WorkItem) -> None:
        """A request answered by its batch: its time queued and its batch's compute."""
        started = item.started or item.arrived
        queued, computed = int((started - item.arrived) * 1e9), int((time.monotonic() - started) * 1e9)
        with self._lock:
            self.queue_ns += queued
            self.request_compute_ns += computed

    def executed(self, rows: int, ns: int, by_size: bool = True) -> None:
        """A batch of `rows` computed in `ns` (`by_size`: counted under its size too)."""
        now_ms = int(time.time() * 1000)
        with self._lock:
            self.inference_count += rows
            self.execution_count += 1
            self.compute_ns += ns
            self.last_inference_ms = now_ms
            if by_size:
                entry = self.batches.setdefault(rows, [0, 0])
                entry[0] += 1
                entry[1] += ns

    def answered(self, ok: bool, ns: int) -> None:
        """A request answered (`ok`) or failed, `ns` after it arrived."""
        with self._lock:
            if ok:
                self.success_count += 1
                self.success_ns += ns
            else:
                self.fail_count += 1
                self.fail_ns += ns

    def snapshot(self) -> ModelStats:
        """A copy of the counts as they are now, no update half made."""
        with self._lock:
            return replace(self, batches={k: list(v) for k, v in self.batches.items()}, _lock=threading.Lock())


def checked_feeds(
    specs: list[TensorSpec], inputs: dict[str, np.ndarray], model: str, optional: frozenset[str] = frozenset()
) -> dict[str, np.ndarray]:
    """`inputs` checked against the model's `specs`; an `optional` one (Triton's `optional: true`) may be
    left out, and the graph then runs without it."""
    check_inputs(sorted(s.name for s in specs), inputs, model)
    for s in specs:
        if s.name not in inputs:
            if s.name in optional:
                continue
            raise InvalidArgument(f"model '{model}': missing input '{s.name}'")
        a = inputs[s.name]
        if datatype_of(a) != s.datatype:
            raise InvalidArgument(f"input '{s.name}': datatype {datatype_of(a)}, model '{model}' expects {s.datatype}")
        if a.ndim != len(s.shape):
            raise InvalidArgument(
                f"input '{s.name}': shape {list(a.shape)} has {a.ndim} dimensions, model '{model}' expects "
                f"{len(s.shape)} ({list(s.shape)})"
            )
        for axis, (got, want) in enumerate(zip(a.shape, s.shape, strict=True)):
            if want >= 0 and got != want:
                raise InvalidArgument(
                    f"input '{s.name}': dimension {axis} is {got}, model '{model}' expects {want} ({list(s.shape)})"
                )
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            raise InvalidArgument(f"input '{s.name}': contains NaN or infinite values")
    return inputs


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


def check_inputs(names: list[str], given: Iterable[str], model: str) -> None:
    """InvalidArgument naming the first (by name) of the `given` inputs that the model (its inputs `names`)
    lacks."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise InvalidArgument(f"model '{model}' has no input {quote(unknown[0])} (inputs: {', '.join(names)})")


def check_outputs(names: list[str], asked: list[str], model: str) -> None:
    """InvalidArgument naming the first of the `asked` outputs that the model (its outputs `names`) lacks."""
    for o in asked:
        if o not in names:
            raise InvalidArgument(f"model '{model}' has no output {quote(o)} (outputs: {', '.join(names)})")


def has_batch_axis(config: ModelConfig, specs: list[TensorSpec]) -> bool:
    """Whether axis 0 of every input and output is a batch axis, as Triton decides it: max_batch_size 0 in
    config.json says there is none (shapes are served as declared); above 0, there is one and the graph must
    leave it dynamic; not given, there is one when every first dimension is dynamic (Triton's autocomplete)."""
    fixed = next((s for s in specs if not (s.shape and s.shape[0] < 0)), None)
    if "max_batch_size" not in config.batching_given:
        return fixed is None
    size = config.batching.max_batch_size
    where = f"model '{config.name}' version {config.version}"
    if size < 0:
        raise RepositoryError(f"{where}: max_batch_size must be >= 0 (0: the model has no batch axis), got {size}")
    if size > 0 and fixed is not None:
        first = f"first dimension {fixed.shape[0]}" if fixed.shape else "no dimension (a scalar)"
        raise RepositoryError(
            f"{where}: max_batch_size {size} needs a dynamic batch axis 0 on every input and output, but "
            f"'{fixed.name}' has {first} (shape {list(fixed.shape)}); set max_batch_size 0 to serve the shapes "
            "as declared, without a batch axis"
        )
    return size > 0


def _check_served(config: ModelConfig, inputs: list[TensorSpec], outputs: list[TensorSpec]) -> None:
    """Refuse at load a graph with an input or output of a datatype that is not served, naming it."""
    for what, specs in (("input", inputs), ("output", outputs)):
        for s in specs:
            if s.datatype in NUMPY_DTYPES:
                continue
            v2 = ONNX_UNSERVED.get(s.datatype)
            why = f"datatype {v2} is not served: {UNSERVED[v2]}" if v2 else "no v2 datatype carries it"
            raise RepositoryError(
                f"model '{config.name}' version {config.version}: {what} {quote(s.name)} is {s.datatype}: {why}"
            )


def _as_strings(array: np.ndarray, name: str, model: str) -> np.ndarray:
    """BYTES elements -> Python str, UTF-8 decoded: onnxruntime takes a string tensor as str (a bytes
    element would reach the graph as its repr, b'...')."""
    out = np.empty(array.size, dtype=np.object_)
    for i, x in enumerate(array.reshape(-1)):
        if isinstance(x, str):
            out[i] = x
            continue
        try:
            out[i] = bytes(x).decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(
                f"input '{name}' element {i} is not valid UTF-8 (byte {e.start}): model '{model}' takes it as a "
                "string tensor"
            ) from None
    return out.reshape(array.shape)


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

    def text_words(self, text: str) -> None:
        return None  # a tensor model takes no text

    def max_text_words(self) -> int:
        return 0

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


# Words counted on the raw bytes, before any is decoded or normalized (count_words): whitespace as
# str.split sees it, and punctuation the text rules do not read (a token of it alone is no word).
_ASCII_STRIP = SILENT_ASCII.encode()
_WIDE_STRIP = [c.encode() for c in SILENT_WIDE]
_WIDE_SPACES = [chr(c).encode() for c in range(0x80, 0x3001) if chr(c).isspace()]
_SPACE_OR_LETTER = bytes(0x20 if chr(b).isspace() else 0x61 for b in range(0x80)) + b"a" * 0x80


def count_words(text: bytes) -> int:
    """The words written in `text` (UTF-8), as the text rules see them before reading them out (a token
    of punctuation alone is none), counted by C-level passes over the bytes: no Python object per word,
    so a flood of words is refused before any is built."""
    if not text.isascii():  # wide spaces and marks are more than a byte
        for space in _WIDE_SPACES:
            if space in text:
                text = text.replace(space, b" ")
        for mark in _WIDE_STRIP:
            if mark in text:
                text = text.replace(mark, b"")
    letters = text.translate(_SPACE_OR_LETTER, _ASCII_STRIP)  # " " between words, "a" inside one
    return letters.count(b" a") + letters.startswith(b"a")


def normalize_word(token: str) -> str:
    """What one written word reads as, the spoken words space-separated ("$5" -> "five dollars",
    "Hello," -> "hello", "c.o.d." -> "c.o.d."; "" for punctuation alone): service/models/g2p_text.py."""
    return " ".join(spoken_words(token))


def _control_character(text: str) -> str | None:
    """The first control character in `text` that is not whitespace: no text rule reads one."""
    if text.isprintable():
        return None
    return next((c for c in text if unicodedata.category(c) == "Cc" and not c.isspace()), None)


def _kept(h: Hypothesis) -> Hypothesis:
    """A word's answer as the cache keeps it: no caller's handle, and attention rows of their own (a beam's
    rows are views of the whole beam's history, which a kept row would hold)."""
    return replace(h, tag=None, attention=[a if a.base is None else a.copy() for a in h.attention])


# Where a word's answer came from (output SOURCES): a text rule (a symbol dropped), the pronouncing
# lexicon, or the model; "" for a word without one (REASONS says why).
SOURCE_RULE, SOURCE_LEXICON, SOURCE_MODEL = "rule", "lexicon", "model"
_DROPPED = "symbol {} is not read: dropped, with no separator in PHONEMES"


class G2PModel:
    kind = "g2p"
    caches_words = True  # the response cache keeps each word's answer, not whole requests
    platform = "qkv_g2p"
    compute_span = "qkv.decode"
    inputs: ClassVar[list[TensorSpec]] = [TensorSpec("TEXT", "BYTES", (-1,), ("batch",))]
    outputs: ClassVar[list[TensorSpec]] = [
        TensorSpec("PHONEMES", "BYTES", (-1,), ("batch",)),
        TensorSpec("ATTENTION", "FP32", (-1, -1, -1), ("word", "phoneme", "grapheme")),
        TensorSpec("WORDS", "BYTES", (-1,), ("word",)),  # the words read from TEXT, all elements in order
        TensorSpec("REASONS", "BYTES", (-1,), ("word",)),  # why a word has no phonemes; empty when it has
        TensorSpec("SOURCES", "BYTES", (-1,), ("word",)),  # where each word's answer came from (SOURCE_*)
        TensorSpec("VARIANTS", "BYTES", (-1, -1), ("word", "variant")),  # each word's pronunciations, "" padded
    ]
    text_rules = RULES  # the reading rules' version, which the model card may pin

    def __init__(
        self, config: ModelConfig, runtime: G2PRuntime, observer: ModelObserver, compute: ComputeThreads | None = None
    ) -> None:
        self.config, self.runtime = config, runtime
        self.name, self.version, self.provider = config.name, config.version, runtime.provider
        self.graphemes, self.phonemes = runtime.graphemes, runtime.phonemes
        self.letters = frozenset(self.graphemes.symbols[len(SPECIALS) :])  # what a word may be spelled with
        limits = config.limits
        self.max_word_length = int(limits.get("max_word_length", 32))
        self.max_output_length = int(limits.get("max_output_length", 40))
        self.max_words = int(limits.get("max_words", 64))
        self.max_element_bytes = int(limits.get("max_element_bytes", 1024))
        self.max_beam_size = int(limits.get("max_beam_size", 8))
        # Its outputs' dynamic axes, at most (an ensemble bounds a step's outputs before it runs): the words read
        # (each word written reads as SPOKEN_PER_WORD at most), a word's phonemes, a decoded word's letters.
        self.axis_limits = {
            "word": SPOKEN_PER_WORD * self.max_words,
            "phoneme": self.max_output_length,
            "grapheme": self.max_word_length,
        }
        self.max_batch_size = config.batching.max_batch_size
        pinned = config.card.get("text_normalization", RULES)
        if pinned not in VERSIONS:
            raise RepositoryError(
                f"model '{self.name}' version {self.version}: its model card asks for text_normalization "
                f"{quote(str(pinned))}, this server reads text by rules {', '.join(map(quote, VERSIONS))}"
            )
        self.text_rules = str(pinned)
        self.lexicon: Lexicon | None = runtime.lexicon  # the version's pronouncing lexicon, when it ships one
        self.stats = ModelStats()
        self.in_flight = InFlight()  # leases of requests between their lookup and their answer (the server's)
        self.scheduler = GenerationScheduler(self.name, config.batching, runtime.instances, observer, compute)
        self.admission = self.scheduler.admission
        # config.json response_cache: each word's answer kept (set by the registry when the server has a cache)
        self.cache: ResponseCache[Hypothesis] | None = None

    def warm_up(self) -> None:
        """One word decoded on each instance before serving: graphs that load but cannot run are refused
        here, and onnxruntime's first runs (which allocate) happen before any request waits on them.
        Then one full batch, timed, for admission."""
        try:
            source = [self.graphemes.encode("warm")]
            for instance in self.runtime.instances:
                greedy_decode(instance, source, self.max_output_length)
            # A full batch gives admission its first estimate of capacity, in word-steps per second
            # (a request's queued tokens are its words x their longest length, about the steps they take).
            rows = max(1, self.max_batch_size)
            started = time.perf_counter()
            hyps = greedy_decode(self.runtime.instances[0], source * rows, self.max_output_length, batch_size=rows)
            steps = max(len(h.tokens) - 1 for h in hyps)
            self.admission.seed(rows * steps, time.perf_counter() - started)
        except Exception as e:  # onnxruntime's own exception types
            raise RepositoryError(f"model '{self.name}' version {self.version}: warm-up failed: {e}") from e

    def batching(self) -> BatchingConfig:
        return self.config.batching

    def batching_sources(self) -> None:
        return None  # g2p's batching is config.json's, not tuned: not shown

    def text_words(self, text: str) -> list[tuple[str, str]]:
        """Each token of `text` that holds a word, with the word as `words` reads it."""
        known = self._known(self.text_rules, True)
        out = []
        for token in text.split():
            if word := " ".join(spoken_words(token, self.max_word_length, rules=self.text_rules, known=known)):
                out.append((token, word))
        return out

    def _known(self, rules: str, use_lexicon: bool) -> Known | None:
        """What the text rules may ask of the lexicon (en-2 splits words it lacks at words it has)."""
        return self.lexicon.known if self.lexicon is not None and use_lexicon and rules != "en-1" else None

    def max_text_words(self) -> int:
        return self.max_words

    def config_parameters(self) -> dict[str, str]:
        lexicon = self.lexicon
        held = f"{len(lexicon)} words, {lexicon.entries} pronunciations" if lexicon is not None else "none"
        return {"text_normalization": self.text_rules, "lexicon": held}  # the rules that read text, the lexicon

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        """Decoding begins; `on_failure` hears if a decoding thread dies (the registry takes the version out)."""
        self.scheduler.tracer = tracer
        self.scheduler.on_failure = on_failure
        self.scheduler.start()

    async def close(self) -> None:
        """Take no new requests; return once the queued and decoding words are answered."""
        await self.scheduler.close()

    def release(self) -> None:
        """Free the sessions (after `close`)."""
        self.runtime.instances.clear()
        self.scheduler.models.clear()

    def input_limits(self, name: str) -> InputLimits:
        """TEXT holds at most max_words elements (each holds a word or more) of max_element_bytes each."""
        if name != "TEXT":
            return InputLimits()
        why = f"model '{self.name}' takes at most max_words {self.max_words} words, one or more an element"
        return InputLimits(self.max_words, self.max_element_bytes, why)

    def _raw_text(self, text: np.ndarray) -> list[bytes]:
        """TEXT's elements as bytes, their number and sizes checked before any is read."""
        elements = text.reshape(-1)
        if len(elements) > self.max_words:  # every element holds a word or more
            raise InvalidArgument(
                f"input 'TEXT': {len(elements)} elements, the limit is max_words {self.max_words} "
                "(each holds one word or more)"
            )
        out = []
        for i, raw in enumerate(elements):
            if not isinstance(raw, bytes):
                raw = str(raw).encode(errors="surrogatepass")
            if len(raw) > self.max_element_bytes:
                raise InvalidArgument(
                    f"input 'TEXT' element {i}: {len(raw)} bytes, the limit is {self.max_element_bytes}"
                )
            out.append(raw)
        total = count_words(b" ".join(out))  # on the bytes as received, before any word is built
        if total > self.max_words:
            raise InvalidArgument(f"input 'TEXT': {total} words in one request, the limit is {self.max_words}")
        return out

    def words(self, text: np.ndarray) -> list[list[str]]:
        """Each TEXT element -> its words, read by the text rules (service/models/g2p_text.py)."""
        return self._words(self._raw_text(text), self.text_rules, self._known(self.text_rules, True))

    def _words(self, elements: list[bytes], rules: str, known: Known | None) -> list[list[str]]:
        out = []
        total, limit = 0, SPOKEN_PER_WORD * self.max_words
        for i, raw in enumerate(elements):
            try:
                s = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"input 'TEXT' element {i} is not valid UTF-8 (byte {e.start})") from None
            control = _control_character(s)
            if control is not None:  # not text a person writes: the whole request says so
                token = next(t for t in s.split() if control in t)
                raise InvalidArgument(
                    f"input 'TEXT' element {i}: the model cannot spell character {quote(control)} "
                    f"(U+{ord(control):04X}) in {quote(token, 40)}: a control character"
                )
            words = spoken_words(s, self.max_word_length, limit - total, rules, known)
            if not words:
                raise InvalidArgument(f"input 'TEXT' element {i} is empty: no word to convert")
            total += len(words)
            if total > limit:  # read no further than the limit
                raise InvalidArgument(
                    f"input 'TEXT': its words read as more than {limit} words (numbers spelled out), the limit "
                    f"is {limit} ({SPOKEN_PER_WORD} x max_words {self.max_words})"
                )
            out.append(words)
        return out

    def _unspellable(self, word: str) -> str:
        """Why the model cannot decode `word`, or "" when it can."""
        if len(word) <= self.max_word_length and self.letters.issuperset(word):
            return ""
        bad = next((c for c in word if c not in self.letters), None)
        if bad is not None:
            return f"the model cannot spell character {quote(bad)} (U+{ord(bad):04X}) in {quote(word, 40)}"
        if len(word) > self.max_word_length:  # the text rules cut long words: only a rule's fault gets here
            return f"word {quote(word, 40)} has {len(word)} letters, the limit is {self.max_word_length}"
        return ""

    def _int_param(self, params: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
        value = params.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int):
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(f"parameter '{name}' must be an integer, got {got}")
        if not low <= value <= high:
            raise InvalidArgument(f"parameter '{name}' must be in [{low}, {high}], got {value}")
        return value

    def _bool_param(self, params: dict[str, Any], name: str, default: bool) -> bool:
        value = params.get(name, default)
        if not isinstance(value, bool):
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(f"parameter '{name}' must be a boolean, got {got}")
        return value

    def _rules_param(self, params: dict[str, Any]) -> str:
        """The text rules a request pins (parameter text_normalization), or the model card's."""
        value = params.get("text_normalization", self.text_rules)
        if value not in VERSIONS:
            got = quote(value) if isinstance(value, str) else repr(value)
            raise InvalidArgument(
                f"parameter 'text_normalization' must be one of {', '.join(map(quote, VERSIONS))}, got {got}"
            )
        return str(value)

    def _word_keys(self, words: list[str], max_out: int, beam: int, with_attention: bool) -> list[bytes]:
        """What determines each word's answer: this loaded version and the decoding asked for (one digest
        a request, of fixed length), then the word (letters of this version's graphemes only)."""
        asked = cache_key([self.name, self.version, id(self), max_out, beam, with_attention])
        return [asked + w.encode() for w in words]

    async def _answers(
        self,
        words: list[str],
        max_out: int,
        beam: int,
        with_attention: bool,
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> list[Hypothesis]:
        """Each word's hypothesis: kept ones from the response cache (when on), the others decoded, each
        word once however often the request holds it."""
        keys = self._word_keys(words, max_out, beam, with_attention) if self.cache else []
        hyps: list[Hypothesis | None] = (
            self.cache.get_many(keys, self.name, self.version) if self.cache else [None] * len(words)
        )
        todo: dict[str, int] = {}  # a word to decode -> its first place in the request
        for i, (word, h) in enumerate(zip(words, hyps, strict=True)):
            if h is None:
                todo.setdefault(word, i)
        if todo:
            firsts = list(todo.values())
            sources = [self.graphemes.encode(w) for w in todo]
            fresh = await self._decode(sources, max_out, beam, with_attention, deadline, trace)
            by_word = dict(zip(todo, fresh, strict=True))
            hyps = [h if h is not None else by_word[w] for w, h in zip(words, hyps, strict=True)]
            if self.cache is not None:
                for i, h in zip(firsts, fresh, strict=True):  # kept without its request (`tag`)
                    kept = _kept(h)
                    self.cache.put(keys[i], kept, deep_size(kept), self.name, self.version)
        return [h for h in hyps if h is not None]  # every word has its hypothesis now

    async def _decode(
        self,
        sources: list[list[int]],
        max_out: int,
        beam: int,
        with_attention: bool,
        deadline: float | None,
        trace: RequestTrace | None,
    ) -> list[Hypothesis]:
        """`sources` decoded by the scheduler, in continuous batches shared with other requests' words."""
        item = WorkItem(
            rows=len(sources) * beam,  # a beam search decodes each word in `beam` rows: its cost
            length=max(map(len, sources)) + 1,
            payload=WordsRequest(sources, max_out, beam, with_attention),
            future=asyncio.get_running_loop().create_future(),
            deadline=deadline,
            trace=trace,
        )
        t0 = time.perf_counter_ns()
        hyps: list[Hypothesis] = await self.scheduler.submit(item)
        self.stats.account_request(item)
        # Its words decode in continuous batches shared with others: no batch size of its own.
        self.stats.executed(len(sources), time.perf_counter_ns() - t0, by_size=False)
        return hyps

    async def infer(
        self,
        inputs: dict[str, np.ndarray],
        outputs: list[str],
        params: dict[str, Any],
        deadline: float | None,
        trace: RequestTrace | None = None,
    ) -> Result:
        check_inputs(["TEXT"], inputs, self.name)
        if "TEXT" not in inputs:
            raise InvalidArgument(f"model '{self.name}': missing input 'TEXT'")
        text = inputs["TEXT"]
        if text.dtype != np.object_:
            raise InvalidArgument(f"input 'TEXT': datatype must be BYTES, model '{self.name}' got a numeric tensor")
        if text.size == 0:
            raise InvalidArgument("input 'TEXT' has no elements")
        names = [o.name for o in self.outputs]
        check_outputs(names, outputs, self.name)
        beam = self._int_param(params, "beam_size", 1, 1, self.max_beam_size)
        max_out = self._int_param(params, "max_output_length", self.max_output_length, 1, self.max_output_length)
        use_lexicon = self._bool_param(params, "lexicon", True) and self.lexicon is not None
        rules = self._rules_param(params)
        known = self._known(rules, use_lexicon)
        raw = self._raw_text(text)
        if sum(map(len, raw)) > THREAD_TEXT_BYTES:  # a large legal request: its words built off the event loop
            elements = await asyncio.to_thread(self._words, raw, rules, known)
        else:
            elements = self._words(raw, rules, known)
        flat = [w for ws in elements for w in ws]
        dropped = [rules != "en-1" and is_symbol(w) for w in flat]  # emoji and other signs: not read (en-2)
        sources = [SOURCE_RULE if d else "" for d in dropped]
        answers: list[list[str]] = [[] for _ in flat]  # each word's pronunciations, its answer first
        if use_lexicon and self.lexicon is not None:  # looked up before anything is batched
            asked = [i for i, d in enumerate(dropped) if not d]
            for i, (at, first) in zip(asked, self.lexicon.answers([flat[i] for i in asked]), strict=True):
                if at >= 0:
                    sources[i] = SOURCE_LEXICON
                    answers[i] = self.lexicon.pronunciations(at) if "VARIANTS" in outputs else [first]
        reasons = [
            _DROPPED.format(quote(w, 40)) if d else "" if s else self._unspellable(w)
            for w, d, s in zip(flat, dropped, sources, strict=True)
        ]
        spelled = [i for i, why in enumerate(reasons) if not why]  # the words answered, by index in `flat`
        modelled = [i for i in spelled if sources[i] != SOURCE_LEXICON]  # the words decoded, by index
        modelled_words = [flat[i] for i in modelled]
        with_attention = "ATTENTION" in outputs
        longest = max((len(flat[i]) for i in spelled), default=0)
        hyps = await self._answers(modelled_words, max_out, beam, with_attention, deadline, trace)
        decoded: list[list[str]] = [[] for _ in flat]
        for i, h in zip(modelled, hyps, strict=True):
            decoded[i] = self.phonemes.decode(h.output)
            answers[i], sources[i] = [" ".join(decoded[i])], SOURCE_MODEL
        joined, k = [], 0
        for ws in elements:
            mine = range(k, k + len(ws))
            # en-1 separates every word read, en-2 those it does not drop.
            said = [answers[j][0] if answers[j] else "" for j in mine if rules == "en-1" or not dropped[j]]
            joined.append(" | ".join(said).encode())
            k += len(ws)
        result: dict[str, np.ndarray] = {}
        if not outputs or "PHONEMES" in outputs:
            result["PHONEMES"] = np.array(joined, dtype=np.object_).reshape(text.shape)
        if with_attention:  # a row per word read, zeros for one not decoded (the lexicon's among them)
            t = max(map(len, decoded)) or 1
            att = np.zeros((len(flat), t, max(longest, 1)), dtype=np.float32)
            for i, h in zip(modelled, hyps, strict=True):
                d = decoded[i]
                rows = np.array(h.attention[: len(d)], dtype=np.float32).reshape(len(d), -1)
                att[i, : len(d), : rows.shape[1]] = rows
            result["ATTENTION"] = att
        if "WORDS" in outputs:
            result["WORDS"] = np.array([w.encode() for w in flat], dtype=np.object_)
        if "REASONS" in outputs:
            result["REASONS"] = np.array([r.encode() for r in reasons], dtype=np.object_)
        if "SOURCES" in outputs:
            result["SOURCES"] = np.array([x.encode() for x in sources], dtype=np.object_)
        if "VARIANTS" in outputs:
            width = max(map(len, answers), default=0) or 1
            variants = np.full((len(flat), width), b"", dtype=np.object_)
            for i, a in enumerate(answers):
                variants[i, : len(a)] = [v.encode() for v in a]
            result["VARIANTS"] = variants
        decoded_in = sum(map(len, modelled_words))
        return Result(result, longest, decoded_in, sum(len(decoded[i]) for i in modelled))
