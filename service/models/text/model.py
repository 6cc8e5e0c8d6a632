"""The text kind: a Hugging Face folder as exported, text in, embeddings or scores out.

    TEXT (BYTES [N])                    -> EMBEDDING (FP32 [N, D])        embed
    INPUT_IDS (INT64 [N, L], -1 pads)   -> EMBEDDING                      embed, token ids given
    TEXT                                -> SCORES (FP32 [N, C])           classify (labels: id2label)
    QUERY (BYTES [1]) + TEXT            -> SCORES (FP32 [N])              rerank
    and always TOKENS (INT64 [N]: tokens each input ran as) and TRUNCATED (INT64 [N]: tokens cut)

A request's texts are tokenized (service/models/text/tokens.py), fitted to the model's length by the
long-input policy, and handed as token rows to the graph served as a tensor model (`Encoder`,
service/models/text/encoder.py): its dynamic batcher batches rows of all requests by token length, and its
instances' threads pool (or score) each batch before handing it back. Request parameters: `dimensions`,
`long_inputs`, `truncation_side`, `prompt_name`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from functools import cached_property, partial
from typing import TYPE_CHECKING, Any

import numpy as np
from tokenizers import Encoding

from service.datatypes import InputLimits
from service.errors import InvalidArgument, ServingError, quote
from service.models.catalog import TextAnswer, TextAsk
from service.models.common import Metadata, ModelStats, Result, check_inputs, check_outputs
from service.models.runtime import TensorRuntime, TensorSpec
from service.models.text.encoder import POOLED, Encoder
from service.models.text.pooling import activate, l2_normalized, pool, pool_windows, truncated_dimensions
from service.models.text.settings import LONG_INPUTS, SIDES, TOKENIZER_FILE, TextSettings, read_settings
from service.models.text.tasks import task_answer, task_io
from service.models.text.tokens import Fitted, Row, TextTokenizer, fit, from_encoding
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import Admission
from service.scheduling.config import BatchingConfig
from service.scheduling.leases import InFlight

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["TextModel", "build_text_model"]

log = logging.getLogger("qkv.models")

# A request with more text than this is tokenized on a worker thread; a smaller one costs no more than the
# hop (the tokenizer reads a 20-word text in some 40 us, 150 us just after a run of the graph has taken the
# caches, which a worker thread's would be too) and is tokenized on the event loop: several texts in one
# batch call over the tokenizer's threads, a single one by itself (as a batch call, which hands it to those
# threads and waits for them, one 20-word text took some 15 % longer and more CPU, on a loaded machine).
THREAD_TEXT_BYTES = 1 << 12
GRAPH_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
EMBEDDING_OUTPUTS = ("token_embeddings", "last_hidden_state")
# Queue bounds of the text kind where config.json gives none: a request is many texts (its rows are queued
# as several items), and a client sending a corpus would rather wait than be refused a second's work.
QUEUE_DEFAULTS: dict[str, Any] = {"max_queue_wait_ms": 10_000.0, "max_queue_tokens": 1 << 19}


def _spec(name: str, datatype: str, shape: tuple[int, ...]) -> TensorSpec:
    return TensorSpec(name, datatype, shape, ("batch",) + (None,) * (len(shape) - 1))


class TextModel:
    kind = "text"
    platform = "qkv_text"
    compute_span = "qkv.compute"

    def __init__(
        self, config: ModelConfig, providers: list[Any], observer: ModelObserver, compute: ComputeThreads
    ) -> None:
        where = f"model '{config.name}' version {config.version}"
        self.settings: TextSettings = read_settings(config.directory, config.text, where)
        s = self.settings
        self.tokenizer = TextTokenizer(config.directory / TOKENIZER_FILE, where)
        given = config.batching_given
        batching = replace(config.batching, **{k: v for k, v in QUEUE_DEFAULTS.items() if k not in given})
        inner = replace(config, kind="tensor", sequence_axis=1, inputs=(), outputs=(), batching=batching,
                        limits={"max_sequence_length": s.max_length})  # fmt: skip
        runtime = compute.run_lowered(partial(TensorRuntime, inner, providers))
        graph_inputs = {i.name for i in runtime.inputs}
        unknown = sorted(graph_inputs - set(GRAPH_INPUTS))
        if unknown or not {"input_ids", "attention_mask"} <= graph_inputs:
            raise RepositoryError(
                f"{where}: a text model's graph takes input_ids and attention_mask (and token_type_ids), this one "
                f"takes {sorted(graph_inputs)}"
            )
        self.with_types = "token_type_ids" in graph_inputs
        output, self.dim = self._graph_output(runtime.outputs, where)
        self.encoder = Encoder(inner, runtime, observer, self._head, output, compute)
        self.observer = observer
        self.config = replace(config, outputs=self._declared())
        self.name, self.version, self.provider = config.name, config.version, runtime.provider
        self.in_flight = InFlight()
        self.inputs, self.outputs = self._specs()

    # --- what it is -------------------------------------------------------------------------------------

    def _graph_output(self, outputs: list[TensorSpec], where: str) -> tuple[str, int]:
        """The graph output read and its last dimension (the embedding's size, or the classes)."""
        names = [o.name for o in outputs]
        wanted = self.settings.output or next(
            (n for n in (EMBEDDING_OUTPUTS if self.settings.task == "embed" else ("logits",)) if n in names), names[0]
        )
        spec = next((o for o in outputs if o.name == wanted), None)
        if spec is None:
            raise RepositoryError(f"{where}: text.output {wanted!r} is not an output of the graph ({', '.join(names)})")
        rank = 3 if self.settings.task == "embed" else 2
        if len(spec.shape) != rank:
            raise RepositoryError(
                f"{where}: output {wanted!r} has shape {list(spec.shape)}; a {self.settings.task} model reads one of "
                f"{rank} dimensions"
            )
        return wanted, spec.shape[-1]

    def _specs(self) -> tuple[list[TensorSpec], list[TensorSpec]]:
        task = self.settings.task
        inputs = [_spec("TEXT", "BYTES", (-1,))]
        if task == "embed":
            inputs.append(_spec("INPUT_IDS", "INT64", (-1, -1)))
            result = _spec("EMBEDDING", "FP32", (-1, self.dim))
        elif task == "classify":
            result = _spec("SCORES", "FP32", (-1, self.dim))
        else:
            inputs.append(TensorSpec("QUERY", "BYTES", (1,), (None,)))
            result = _spec("SCORES", "FP32", (-1,))
        return inputs, [result, _spec("TOKENS", "INT64", (-1,)), _spec("TRUNCATED", "INT64", (-1,))]

    def _declared(self) -> tuple[dict[str, Any], ...]:
        """A classifier's SCORES declared with its labels: Triton's classification extension names them."""
        if self.settings.task != "classify" or not self.settings.labels:
            return ()
        return ({"name": "SCORES", "datatype": "FP32", "shape": [-1, self.dim], "labels": self.settings.labels,
                 "label_filename": "config.json"},)  # fmt: skip

    @property
    def max_batch_size(self) -> int:
        return self.encoder.max_batch_size

    @property
    def stats(self) -> ModelStats:
        return self.encoder.stats

    @property
    def admission(self) -> Admission:
        return self.encoder.admission

    def batching(self) -> BatchingConfig:
        return self.encoder.batching()

    def batching_sources(self) -> dict[str, str]:
        return self.encoder.batching_sources()

    def input_limits(self, name: str) -> InputLimits:
        s = self.settings
        if name == "INPUT_IDS":
            return InputLimits(s.max_texts * s.max_length * s.max_chunks, None, f"max_texts {s.max_texts}")
        why = f"model '{self.name}' takes at most max_texts {s.max_texts} texts a request"
        return InputLimits(s.max_texts, s.max_element_bytes, why)

    def config_parameters(self) -> dict[str, str]:
        s = self.settings
        shown = {"task": s.task, "max_length": str(s.max_length), "long_inputs": s.long_inputs}
        if s.task == "embed":
            shown |= {"pooling": s.pooling, "normalize": str(s.normalize).lower(), "dimensions": str(self.dim)}
        return shown

    def text_task(self) -> str:
        return self.settings.task

    def tokenize(self, texts: list[str], special: bool = True) -> list[list[dict[str, Any]]]:
        """Each text's tokens as TEI's /tokenize shows them: id, text, whether special, character span; no
        more texts, nor longer ones, than a request's TEXT may hold."""
        limit = self.input_limits("TEXT")
        if len(texts) > limit.elements or any(len(t.encode()) > (limit.element_bytes or 1 << 30) for t in texts):
            raise InvalidArgument(f"field 'inputs': over the model's limits ({limit.why})")
        encodings = self.tokenizer.tokenizer.encode_batch(texts, add_special_tokens=special)
        return [
            [
                {"id": i, "text": t, "special": bool(m), "start": a if not m else None, "stop": b if not m else None}
                for i, t, m, (a, b) in zip(e.ids, e.tokens, e.special_tokens_mask, e.offsets, strict=True)
            ]
            for e in encodings
        ]

    def task_io(self, ask: TextAsk) -> tuple[dict[str, np.ndarray], list[str]]:
        return task_io(ask, self.settings.task)

    def task_answer(self, outputs: Mapping[str, np.ndarray]) -> TextAnswer:
        return task_answer(outputs, self.settings.task, self.settings.labels)

    # --- lifecycle --------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        self.encoder.warm_up(min(64, self.settings.max_length))

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        self.encoder.start(tracer, on_failure)

    async def close(self) -> None:
        await self.encoder.close()

    def release(self) -> None:
        self.encoder.release()

    # --- a batch's step, on an instance's thread ----------------------------------------------------------

    def _head(self, feeds: dict[str, np.ndarray], out: np.ndarray) -> np.ndarray:
        s = self.settings
        if s.task != "embed":
            return activate(out, s.activation)
        pooled = pool(out, feeds["attention_mask"], s.pooling)
        return l2_normalized(pooled) if s.normalize else pooled

    # --- a request --------------------------------------------------------------------------------------

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
        s = self.settings
        check_inputs([i.name for i in self.inputs], inputs, self.name)
        check_outputs([o.name for o in self.outputs], outputs, self.name)
        policy = _choice(params, "long_inputs", s.long_inputs, LONG_INPUTS)
        if policy == "chunk" and s.task != "embed":
            raise InvalidArgument(f"parameter 'long_inputs': chunk is for embeddings, model '{self.name}' is {s.task}")
        side = _choice(params, "truncation_side", s.truncation_side, SIDES)
        dimensions = _integer(params, "dimensions", self.dim, 1, self.dim) if s.task == "embed" else self.dim
        started = time.perf_counter()
        fitted = await self._fitted(inputs, params, policy, side)
        rows = [r for f in fitted for r in f.rows]
        tokenized = time.perf_counter() - started
        self.observer.tokenized(sum(f.tokens for f in fitted), tokenized, any(f.cut for f in fitted))
        values = await self._run(rows, deadline, trace)
        result = self._answer(fitted, rows, values, dimensions)
        tokens = np.array([f.tokens for f in fitted], dtype=np.int64)
        out = {
            result[0]: result[1],
            "TOKENS": tokens,
            "TRUNCATED": np.array([f.cut for f in fitted], dtype=np.int64),
        }
        if outputs:
            out = {k: v for k, v in out.items() if k in outputs}
        longest = max((len(r.ids) for r in rows), default=0)
        return Result(out, longest, int(tokens.sum()), 0)

    async def _fitted(
        self, inputs: dict[str, np.ndarray], params: dict[str, Any], policy: str, side: str
    ) -> list[Fitted]:
        """Each input as token rows, fitted to max_length by `policy`."""
        s = self.settings
        fitting = partial(fit, max_length=s.max_length, policy=policy, side=side, overlap=s.chunk_overlap,
                          max_chunks=s.max_chunks)  # fmt: skip
        if "INPUT_IDS" in inputs:
            if "TEXT" in inputs:
                raise InvalidArgument("inputs 'TEXT' and 'INPUT_IDS' given together: a request takes one of them")
            return [fitting(i, *ids, field="INPUT_IDS") for i, ids in enumerate(self._given_ids(inputs["INPUT_IDS"]))]
        if "TEXT" not in inputs:
            raise InvalidArgument(f"model '{self.name}': missing input 'TEXT'")
        texts = _texts(inputs["TEXT"], "TEXT", s.max_texts, s.strip)
        if s.task == "rerank":
            if "QUERY" not in inputs:
                raise InvalidArgument(f"model '{self.name}': missing input 'QUERY' (a reranker scores TEXT against it)")
            (query,) = _texts(inputs["QUERY"], "QUERY", 1, s.strip)
            encode: Callable[..., list[Encoding]] = partial(self.tokenizer.encode_pairs, query)
            size = sum(map(len, texts)) + len(query) * len(texts)
        else:
            prefix = self._prompt(params)
            texts = [prefix + t for t in texts] if prefix else texts
            encode, size = self.tokenizer.encode, sum(map(len, texts))
        if size > THREAD_TEXT_BYTES:
            encodings = await asyncio.to_thread(encode, texts)
        else:
            encodings = encode(texts, parallel=len(texts) > 1)
        return [fitting(i, *from_encoding(e)) for i, e in enumerate(encodings)]

    def _prompt(self, params: dict[str, Any]) -> str:
        s = self.settings
        name = params.get("prompt_name", s.default_prompt)
        if not isinstance(name, str):
            raise InvalidArgument("parameter 'prompt_name' must be a string")
        if name and name not in s.prompts:
            known = ", ".join(sorted(s.prompts)) or "none"
            raise InvalidArgument(
                f"parameter 'prompt_name': {quote(name)} is not a prompt of model '{self.name}' ({known})"
            )
        return s.prompts.get(name, "")

    def _given_ids(self, ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """INPUT_IDS [N, L]: each row's ids up to its first -1 (the padding), checked against the vocabulary."""
        if ids.ndim != 2 or ids.dtype.kind not in "iu":
            raise InvalidArgument(f"input 'INPUT_IDS' must be integers of shape [N, L], got {ids.dtype} {ids.shape}")
        limit = self.settings.max_texts
        if not 1 <= len(ids) <= limit:
            raise InvalidArgument(f"input 'INPUT_IDS': {len(ids)} rows, allowed 1 to max_texts {limit}")
        out = []
        for i, row in enumerate(ids.astype(np.int64)):
            pad = np.flatnonzero(row == -1)
            row = row[: pad[0]] if len(pad) else row
            if not len(row):
                raise InvalidArgument(f"input 'INPUT_IDS' row {i} has no tokens")
            if row.min() < 0 or row.max() >= self.tokenizer.vocab_size:
                bad = int(row.min()) if row.min() < 0 else int(row.max())
                raise InvalidArgument(
                    f"input 'INPUT_IDS' row {i}: token id {bad} outside the vocabulary [0, {self.tokenizer.vocab_size})"
                )
            out.append((row, np.zeros_like(row), np.zeros_like(row)))
        return out

    async def _run(self, rows: list[Row], deadline: float | None, trace: RequestTrace | None) -> list[np.ndarray]:
        """Each row's pooled embedding (or scores), the rows sorted by length and handed to the batcher in
        groups of similar length, which it batches with other requests' rows."""
        order = sorted(range(len(rows)), key=lambda i: len(rows[i].ids))
        config = self.encoder.batcher.config
        groups: list[list[int]] = []
        for i in order:
            length = len(rows[i].ids)
            if (
                groups
                and len(groups[-1]) < config.max_batch_size
                and (len(groups[-1]) + 1) * length <= max(config.token_budget, length)
            ):
                groups[-1].append(i)
            else:
                groups.append([i])
        if len(groups) == 1:  # a short request's one group is awaited here: no task of its own, no window
            answers = [await self._group(rows, groups[0], deadline, trace)]
        else:
            answers = await self._groups(rows, groups, deadline, trace)
        out: list[np.ndarray] = [np.empty(0)] * len(rows)
        for g, values in zip(groups, answers, strict=True):
            for i, v in zip(g, values, strict=True):
                out[i] = v
        return out

    async def _groups(self, rows: list[Row], groups: list[list[int]], deadline: float | None,
                      trace: RequestTrace | None) -> list[np.ndarray]:  # fmt: skip
        """Each group's values. A request's groups are queued a few at a time, enough to keep every instance
        busy: a large request neither floods the queue ahead of others' (they interleave) nor is refused for its
        own queued work."""
        window = asyncio.Semaphore(self.encoder.batcher.instances + 1)

        async def queued(group: list[int]) -> np.ndarray:
            async with window:
                return await self._group(rows, group, deadline, trace)

        return list(await asyncio.gather(*(queued(g) for g in groups)))

    async def _group(self, rows: list[Row], index: list[int], deadline: float | None,
                     trace: RequestTrace | None) -> np.ndarray:  # fmt: skip
        if len(index) == 1:  # one row: its own arrays, nothing to pad
            row = rows[index[0]]
            ids, types = row.ids[None], row.types[None]
            mask = np.ones_like(ids)
        else:
            longest = max(len(rows[i].ids) for i in index)
            ids = np.zeros((len(index), longest), dtype=np.int64)
            mask = np.zeros((len(index), longest), dtype=np.int64)
            types = np.zeros((len(index), longest), dtype=np.int64)
            for j, i in enumerate(index):
                n = len(rows[i].ids)
                ids[j, :n], mask[j, :n], types[j, :n] = rows[i].ids, 1, rows[i].types
        feeds = {"input_ids": ids, "attention_mask": mask}
        if self.with_types:
            feeds["token_type_ids"] = types
        result = await self.encoder.infer(feeds, [self.encoder.output], {}, deadline, trace)
        values: np.ndarray = result.outputs[POOLED]
        return values

    def _answer(self, fitted: list[Fitted], rows: list[Row], values: list[np.ndarray],
                dimensions: int) -> tuple[str, np.ndarray]:  # fmt: skip
        """The output's name and value: one embedding (or scores) an input, its windows pooled back."""
        s = self.settings
        if s.task != "embed":
            scores = np.stack(values)
            return "SCORES", (scores[:, 0] if s.task == "rerank" else scores)
        vectors = np.empty((len(fitted), self.dim), dtype=np.float32)
        k = 0
        for i, f in enumerate(fitted):
            n = len(f.rows)
            if n == 1:
                vectors[i] = values[k]
            else:
                tokens = np.array([len(r.ids) for r in rows[k : k + n]])
                vectors[i] = pool_windows(np.stack(values[k : k + n]), tokens, s.normalize)
            k += n
        if dimensions < self.dim:
            vectors = truncated_dimensions(vectors, dimensions, s.normalize)
        return "EMBEDDING", vectors


def _choice(params: dict[str, Any], name: str, default: str, allowed: tuple[str, ...]) -> str:
    value = params.get(name, default)
    if value not in allowed:
        got = quote(value) if isinstance(value, str) else repr(value)
        raise InvalidArgument(f"parameter '{name}' must be one of {', '.join(allowed)}, got {got}")
    return str(value)


def _integer(params: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"parameter '{name}' must be an integer, got {value!r:.64}")
    if not low <= value <= high:
        raise InvalidArgument(f"parameter '{name}' must be in [{low}, {high}], got {value}")
    return value


def _texts(array: np.ndarray, field: str, limit: int, strip: bool) -> list[str]:
    """A BYTES input's elements as text: UTF-8, at least one, at most `limit`, none empty."""
    if array.dtype != np.object_:
        raise InvalidArgument(f"input '{field}': datatype must be BYTES, got a numeric tensor")
    elements = array.reshape(-1)
    if not 1 <= len(elements) <= limit:
        raise InvalidArgument(f"input '{field}': {len(elements)} elements, allowed 1 to {limit}")
    out = []
    for i, raw in enumerate(elements):
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise InvalidArgument(f"input '{field}' element {i} is not valid UTF-8 (byte {e.start})") from None
        text = str(raw).strip() if strip else str(raw)
        if not text:
            raise InvalidArgument(f"input '{field}' element {i} is empty: no text to read")
        out.append(text)
    return out


def build_text_model(
    config: ModelConfig, providers: list[Any], observer: ModelObserver, compute: ComputeThreads
) -> TextModel:
    """A version of the text kind, sessions built, not yet warm, its threads run as `compute` says."""
    return TextModel(config, providers, observer, compute)
