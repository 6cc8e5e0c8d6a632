"""What the decoding engine is asked (`GenerationRequest`: a prompt's token ids and how to choose the next
tokens) and what it answers (`GenerationChunk`: what a step added, or the answer's end)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from service.seq2seq.beams import EarlyStopping

__all__ = ["FINISH_REASONS", "FinishReason", "GenerationChunk", "GenerationRequest"]

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
