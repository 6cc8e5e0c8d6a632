"""What the engine needs of a model's graphs: one step of a decoder over per-sequence key/value caches.

A cache is a list of arrays, one a past input of the decoder, each (B, H, P, D) in a call and (H, P, D) a
sequence's own. `CacheLayout` says which arrays grow with each step (the decoder's own self-attention) and
which are fixed once the prompt is read (an encoder-decoder's cross-attention keys and values).

- `DecoderOnly`: a call runs rows of new tokens over their caches (prefill and decoding alike).
- `EncoderDecoder`: the encoder once per prompt, then the decoder's first step (`start`, no past), then
  steps with past. `masked`: the decoder takes a self-attention mask, so rows of different cache lengths
  run in one call, left-padded.
- `StartsFromEncoder`: an encoder-decoder whose decoder with past can also take the first step, given the
  cross-attention arrays the encoder's output makes (g2p's graphs: the encoder gives the cross keys and
  values): a new prompt then joins the step's decoding call instead of a `start` call of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["CacheLayout", "DecoderOnly", "EncoderDecoder", "StartsFromEncoder"]


@dataclass(frozen=True)
class CacheLayout:
    """The past inputs of a decoder, in order, and the present outputs that give them back."""

    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    heads: int
    head_dim: int
    self_attention: tuple[bool, ...]  # per input: a decoder (self-attention) cache, grown each step


class DecoderOnly(Protocol):
    @property
    def past(self) -> CacheLayout: ...
    @property
    def dtype(self) -> type[np.floating[Any]]: ...

    def run(self, ids: np.ndarray, mask: np.ndarray, positions: np.ndarray,
            past: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """ids (B, T), mask (B, P+T), positions (B, T), past (B, H, P, D) each -> logits (B, T, V), present."""
        ...


@runtime_checkable
class EncoderDecoder(Protocol):
    @property
    def past(self) -> CacheLayout: ...
    @property
    def dtype(self) -> type[np.floating[Any]]: ...
    @property
    def masked(self) -> bool: ...

    def encode(self, ids: np.ndarray, mask: np.ndarray) -> Any:
        """(B, S) ids and mask -> what the decoder reads of the prompt (hidden states)."""
        ...

    def start(self, ids: np.ndarray, hidden: Any, mask: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
        """The first decoder step, no past: ids (B, 1) -> logits (B, 1, V), present (the past's order)."""
        ...

    def step(self, ids: np.ndarray, mask: np.ndarray, past: list[np.ndarray],
             self_mask: np.ndarray | None = None) -> tuple[np.ndarray, list[np.ndarray]]:  # fmt: skip
        """ids (B, 1), the encoder mask (B, S), past, the self-attention mask (B, P+1) where `masked` ->
        logits (B, 1, V), present (the cross-attention arrays as given)."""
        ...


@runtime_checkable
class StartsFromEncoder(Protocol):
    @property
    def room(self) -> int:
        """Positions a self-attention past array is given past those it holds (a view of the leading ones is
        passed): the decoder writes the step's keys and values there, in place, and gives views back."""
        ...

    def first_cache(self, hidden: Any) -> list[np.ndarray]:
        """A cache for the encoded rows, before their first step: the self-attention arrays empty
        (B, H, 0, D), the cross-attention ones from the encoder's output (B, H, S, D)."""
        ...

    def attention(self) -> np.ndarray | None:
        """The last call's cross-attention (B, S), where the graph gives it."""
        ...
