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
from typing import Protocol, runtime_checkable

from service.decoding.request import FINISH_REASONS, FinishReason, GenerationChunk, GenerationRequest
from service.seq2seq.beams import EarlyStopping

__all__ = ["FINISH_REASONS", "EarlyStopping", "FinishReason", "GenerationChunk", "GenerationDefaults",
           "GenerationRequest", "Generator"]  # fmt: skip


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
