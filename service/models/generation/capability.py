"""The generation capability: what a front end asks of a model that generates, and what it hears back.

A front end (OpenAI's completions and chat, Triton's generate extension, gRPC's decoupled stream) turns
its wire format into one `GenerationRequest`, with every field checked and every default filled from
the model's `GenerationDefaults`, and reads the answer as an async stream of `GenerationChunk`s. The
last chunk carries `finish_reason`. A front end that stops reading (its client went away) closes the
stream (`aclose`), and the model frees the sequence's cache within one decoding step.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

from service.seq2seq.beams import EarlyStopping

__all__ = ["FINISH_REASONS", "EarlyStopping", "FinishReason", "GenerationChunk", "GenerationDefaults",
           "GenerationRequest", "Generator"]  # fmt: skip

FinishReason = Literal["stop", "length"]
FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length")  # "stop": EOS, a stop token or a stop string


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt to continue, already checked: token ids, and how to choose the next tokens."""

    prompt_ids: tuple[int, ...]  # the prompt as the model's tokenizer encoded it (special tokens included)
    max_tokens: int  # output tokens at most, EOS included (counted as transformers' generate counts them)
    do_sample: bool = False  # False: greedy (num_beams 1) or beam search
    temperature: float = 1.0  # > 0; used when sampling
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None  # a sampled answer repeats for the same seed and prompt
    num_beams: int = 1  # > 1: beam search, answered once the search ends (not token by token)
    length_penalty: float = 1.0  # beam search: a hypothesis scores log-prob / length ** length_penalty
    early_stopping: EarlyStopping = False  # beam search: when it stops, as transformers' early_stopping
    repetition_penalty: float = 1.0  # > 0; as transformers' RepetitionPenaltyLogitsProcessor
    stop: tuple[str, ...] = ()  # stop strings: the output ends before the first one (not included)
    stop_token_ids: tuple[int, ...] = ()  # besides the model's EOS ids; the stop token is not in the text
    ignore_eos: bool = False  # run to max_tokens whatever the model says
    deadline: float | None = None  # time.monotonic() after which the request is answered DEADLINE_EXCEEDED
    priority: int = 0  # the admission priority, as v2's `priority` parameter


@dataclass(frozen=True)
class GenerationChunk:
    """What one decoding step added to an answer, or the answer's end."""

    token_ids: tuple[int, ...]  # the new output tokens (a beam search: all of them, in its one chunk)
    text: str  # the new text: decoded incrementally, so a character split over tokens comes out whole
    finish_reason: FinishReason | None = None  # set on the last chunk only
    prompt_tokens: int = 0  # the prompt's tokens, on every chunk
    completion_tokens: int = 0  # output tokens so far, EOS included


@dataclass(frozen=True)
class GenerationDefaults:
    """What the folder says about generating: the limits a request is checked against, and the defaults
    a field left out takes (generation_config.json, then config.json, then transformers' own)."""

    max_positions: int  # prompt plus output tokens the model can attend to (decoder-only), or 0: unbounded
    max_prompt_tokens: int  # the longest prompt taken
    max_new_tokens: int  # `max_tokens` when a request leaves it out
    eos_token_ids: tuple[int, ...]
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    num_beams: int = 1
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    repetition_penalty: float = 1.0


@runtime_checkable
class Generator(Protocol):
    """A served version that generates text: the capability front ends look up."""

    @property
    def folder(self) -> Path: ...  # the exported folder: tokenizer files, chat_template.jinja, configs

    @property
    def defaults(self) -> GenerationDefaults: ...

    @property
    def is_encoder_decoder(self) -> bool: ...

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """`text` as the model's tokenizer encodes it."""
        ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationChunk]:
        """The answer, chunk by chunk. Raises ServingError (InvalidArgument, ResourceExhausted, ...)
        before the first chunk for a request it refuses."""
        ...
