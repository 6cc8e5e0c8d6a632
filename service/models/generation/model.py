"""The generation kind: a Hugging Face folder as optimum exports it, text in, generated text out.

    text_input (BYTES [1])  ->  text_output (BYTES [1]), finish_reason (BYTES [1]),
                                prompt_tokens (INT64 [1]), completion_tokens (INT64 [1])

as a plain v2 infer (parameters max_tokens, temperature, top_p, top_k, seed, num_beams, length_penalty,
early_stopping, repetition_penalty, stop, stop_token_ids, ignore_eos), and as the `Generator` capability the
streaming front ends read chunk by chunk. The graphs run in one decoding engine (service.decoding) per version; a
beam search (num_beams > 1) runs its beams as rows of the same batch and answers in one chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from service.datatypes import InputLimits
from service.decoding.choosing import Chooser
from service.decoding.detokenize import Detokenizer
from service.decoding.engine import Engine, Message, Sequence
from service.errors import InvalidArgument, ServingError
from service.models.catalog import Context, Kind, ServedVersion
from service.models.common import Metadata, ModelStats, Result, check_inputs, check_outputs
from service.models.generation.capability import GenerationChunk, GenerationDefaults, GenerationRequest
from service.models.generation.folder import read_folder, read_tokenizer, recognises
from service.models.generation.graphs import CausalGraph, Seq2SeqGraphs, graph_files
from service.models.generation.requests import check_request, from_parameters
from service.models.runtime import TensorSpec
from service.observability.metrics import ModelObserver
from service.priority import ComputeThreads
from service.repository.layout import ModelConfig, RepositoryError
from service.scheduling.admission import Admission
from service.scheduling.leases import InFlight
from service.seq2seq.graphs import session_options

if TYPE_CHECKING:  # only a tracing server imports it (and opentelemetry)
    from service.observability.tracing import RequestTrace, Tracing

__all__ = ["CACHE_BUDGET", "KIND", "STEP_TOKENS", "GenerationModel", "build_generation_model"]

log = logging.getLogger("qkv.models")

CACHE_BUDGET = 1 << 30  # key/value cache bytes the running sequences may reserve (limits.cache_bytes)
STEP_TOKENS = 256  # tokens a step runs, decoding and prefill together (batching.token_budget when given)
MAX_RUNNING = 64  # sequences in the running batch (batching.max_batch_size when given)
# An encoder-decoder whose decoder takes no self-attention mask (masking.py did not recognise its graph) runs
# its decoder rows in groups of equal length: its new sequences join a running batch this many together, or
# fewer after this wait (batching.min_join_rows, batching.max_queue_delay_ms when given).
MIN_JOIN = 8
JOIN_DELAY_MS = 20.0
MAX_TEXT_BYTES = 1 << 20
OUTPUTS = (("text_output", "BYTES"), ("finish_reason", "BYTES"), ("prompt_tokens", "INT64"),
           ("completion_tokens", "INT64"))  # fmt: skip


class GenerationModel:
    kind = "generation"
    platform = "qkv_generation"
    compute_span = "qkv.generate"

    def __init__(
        self,
        config: ModelConfig,
        providers: list[Any],
        observer: ModelObserver | None,
        compute: ComputeThreads | None = None,
    ) -> None:
        compute = compute or ComputeThreads()
        where = f"model '{config.name}' version {config.version}"
        directory = config.directory
        files = graph_files(directory)
        if not files:
            raise RepositoryError(
                f"{where}: no generation graphs in {directory}: model.onnx (text-generation-with-past), or "
                "encoder_model.onnx with decoder_model_merged.onnx or decoder_model.onnx and "
                "decoder_with_past_model.onnx (text2text-generation-with-past)"
            )
        self.tokenizer = read_tokenizer(directory, where)
        options = session_options(config.intra_op_threads, config.inter_op_threads, config.optimization)
        graph: CausalGraph | Seq2SeqGraphs
        if len(files) == 1:
            graph = compute.run_lowered(lambda: CausalGraph(directory, options, providers, where))
        else:
            graph = compute.run_lowered(lambda: Seq2SeqGraphs(directory, files, options, providers, where))
        self.graph = graph
        self.settings = read_folder(directory, len(files) > 1, self.tokenizer, where)
        given = config.batching_given
        self.config = config
        self.name, self.version = config.name, config.version
        self.provider = str(providers[0]) if providers else "CPUExecutionProvider"
        self.observer = observer
        self.in_flight = InFlight()
        self.stats = ModelStats()
        self.admission = Admission(config.name, config.batching, 1)
        limits = config.limits
        budget = int(limits.get("cache_bytes", 1073741824))  # CACHE_BUDGET, written out for the docs' check
        self.engine = Engine(
            config.name, graph, compute, self.settings.defaults.eos_token_ids, self.settings.decoder_start,
            self.settings.defaults.max_positions,
            cache_budget=budget,
            step_tokens=config.batching.token_budget if "token_budget" in given else STEP_TOKENS,
            max_running=config.batching.max_batch_size if "max_batch_size" in given else MAX_RUNNING,
            max_waiting=config.batching.max_queue_requests,
            observer=observer.generation(budget) if observer is not None else None,
            min_join=config.batching.min_join_rows if "min_join_rows" in given else MIN_JOIN,
            join_delay=(config.batching.max_queue_delay_ms if "max_queue_delay_ms" in given else JOIN_DELAY_MS) / 1e3,
        )  # fmt: skip
        self.inputs = [TensorSpec("text_input", "BYTES", (1,), (None,))]
        self.outputs = [TensorSpec(n, t, (1,), (None,)) for n, t in OUTPUTS]

    # --- what it is -------------------------------------------------------------------------------------

    @property
    def folder(self) -> Path:
        return self.config.directory

    @property
    def defaults(self) -> GenerationDefaults:
        return self.settings.defaults

    @property
    def is_encoder_decoder(self) -> bool:
        return isinstance(self.graph, Seq2SeqGraphs)

    @property
    def max_batch_size(self) -> int:
        return 0

    def input_limits(self, name: str) -> InputLimits:
        return InputLimits(1, MAX_TEXT_BYTES, f"model '{self.name}' takes one text a request")

    def config_parameters(self) -> dict[str, str]:
        d = self.settings.defaults
        return {
            "architecture": "encoder-decoder" if self.is_encoder_decoder else "decoder-only",
            "max_prompt_tokens": str(d.max_prompt_tokens),
            "max_new_tokens": str(d.max_new_tokens),
            "step_tokens": str(self.engine.step_tokens),
            "cache_bytes": str(self.engine.cache_budget),
        }

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.tokenizer.encode(text, add_special_tokens=special_tokens).ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    # --- lifecycle --------------------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Two steps of a one-token prompt, on this thread (the engine's thread is not started yet)."""
        request = GenerationRequest(prompt_ids=(self.settings.defaults.eos_token_ids[0],), max_tokens=2,
                                    ignore_eos=True)  # fmt: skip
        s = self._sequence(request, asyncio.Queue())
        s.reserved = 0
        self.engine.running.append(s)
        for _ in range(2):
            if self.engine.running:
                self.engine.step()
        self.engine.running.clear()

    def start(self, tracer: Tracing | None = None, on_failure: Callable[[ServingError], None] | None = None) -> None:
        self.engine.start()

    async def close(self) -> None:
        await asyncio.to_thread(self.engine.close)

    def release(self) -> None:
        return None

    # --- generating -------------------------------------------------------------------------------------

    def _sequence(self, request: GenerationRequest, queue: asyncio.Queue[Message]) -> Sequence:
        chooser = Chooser(request.do_sample, request.temperature, request.top_k, request.top_p,
                          request.repetition_penalty, request.seed)  # fmt: skip
        return Sequence(request, chooser, Detokenizer(self.decode, request.stop), queue)

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The answer chunk by chunk; closing the stream early cancels the sequence (freed within a step)."""
        check_request(request, self.settings.defaults, self.settings.vocab_size, self.name)
        queue: asyncio.Queue[Message] = asyncio.Queue()
        sequence = self._sequence(request, queue)
        self.engine.submit(sequence)
        finished = False
        try:
            while True:
                message = await queue.get()
                if isinstance(message, ServingError):
                    finished = True
                    raise message
                if message.finish_reason is not None:
                    finished = True
                yield message
                if finished:
                    return
        finally:
            if not finished:
                self.engine.cancel(sequence)

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
        check_inputs(["text_input"], inputs, self.name)
        check_outputs([n for n, _ in OUTPUTS], outputs, self.name)
        if "text_input" not in inputs:
            raise InvalidArgument(f"model '{self.name}': missing input 'text_input'")
        text = _text(inputs["text_input"])
        prompt = tuple(self.encode(text))
        request = from_parameters(prompt, params, self.settings.defaults, deadline)
        pieces: list[str] = []
        reason, completion = "", 0
        async for chunk in self.generate(request):
            pieces.append(chunk.text)
            completion = chunk.completion_tokens
            reason = chunk.finish_reason or reason
        out = {
            "text_output": np.array(["".join(pieces).encode()], dtype=np.object_),
            "finish_reason": np.array([reason.encode()], dtype=np.object_),
            "prompt_tokens": np.array([len(prompt)], dtype=np.int64),
            "completion_tokens": np.array([completion], dtype=np.int64),
        }
        if outputs:
            out = {k: v for k, v in out.items() if k in outputs}
        return Result(out, len(prompt), len(prompt), completion)


def _text(array: np.ndarray) -> str:
    if array.dtype != np.object_:
        raise InvalidArgument("input 'text_input': datatype must be BYTES, got a numeric tensor")
    elements = array.reshape(-1)
    if len(elements) != 1:
        raise InvalidArgument(f"input 'text_input': one text a request, got {len(elements)} elements")
    raw = elements[0]
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InvalidArgument(f"input 'text_input' is not valid UTF-8 (byte {e.start})") from None
    text = str(raw)
    if not text:
        raise InvalidArgument("input 'text_input' is empty: no prompt")
    return text


def build_generation_model(
    config: ModelConfig, providers: list[Any], observer: ModelObserver, compute: ComputeThreads
) -> GenerationModel:
    """A version of the generation kind, sessions built, not yet warm, its decoding thread run as `compute` says."""
    return GenerationModel(config, providers, observer, compute)


def _build(config: ModelConfig, context: Context) -> ServedVersion:
    return build_generation_model(config, context.providers, context.observer, context.compute)


KIND = Kind(
    _build, limits=("cache_bytes",), recognises=recognises
)  # the key/value cache the running sequences may reserve
