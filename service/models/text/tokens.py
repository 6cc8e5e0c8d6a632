"""Text to token rows: Hugging Face `tokenizers` on the folder's tokenizer.json, then the long-input policy.

The tokenizer is loaded with its own padding and truncation off (tokenizer.json may pad or cut at a length
of its own: all-MiniLM-L6-v2's says 128, where sentence-transformers reads 256). Each text is encoded whole,
special tokens added, in one batch call; then an input longer than `max_length` is:

- truncated: content tokens dropped from one end (the special tokens stay), a pair's longest sequence
  first (as `truncation="longest_first"`); how many were dropped is counted;
- refused: INVALID_ARGUMENT naming the element and the limit;
- chunked: its content cut into windows of `max_length` tokens, special tokens around each, each window
  sharing `overlap` tokens with the one before; each window is a row, and the rows of one text are pooled
  back into one embedding (service/models/text/pooling.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Encoding, Tokenizer

from service.errors import InvalidArgument
from service.repository.layout import RepositoryError

__all__ = ["Row", "TextTokenizer", "fit"]


@dataclass
class Row:
    """One sequence the graph runs: token ids and their type ids; `text`: the input it comes from."""

    ids: np.ndarray  # int64 [length]
    types: np.ndarray  # int64 [length]
    text: int


@dataclass
class Fitted:
    """An input's rows once its policy is applied, the tokens they hold and the tokens cut."""

    rows: list[Row]
    tokens: int
    cut: int


class TextTokenizer:
    """The folder's tokenizer: thread-safe for encoding (its settings are fixed here, never changed after)."""

    def __init__(self, path: Path, where: str) -> None:
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception type for a file it cannot read
            raise RepositoryError(f"{where}: cannot load {path.name}: {e}") from None
        tokenizer.no_padding()
        tokenizer.no_truncation()
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)

    def encode(self, texts: list[str], parallel: bool = True) -> list[Encoding]:
        """Each text's encoding, special tokens included: in one batch call (the work spread over the
        tokenizer's own threads, the GIL released), or text by text on this thread when not `parallel` (for a
        few short texts, handing them to those threads and waiting for them costs more than the work)."""
        if not parallel:
            return [self.tokenizer.encode(t, add_special_tokens=True) for t in texts]
        encodings: list[Encoding] = self.tokenizer.encode_batch(texts, add_special_tokens=True)
        return encodings

    def encode_pairs(self, first: str, seconds: list[str], parallel: bool = True) -> list[Encoding]:
        """(first, each of `seconds`) as pairs: a cross-encoder's query and documents (`parallel` as `encode`)."""
        if not parallel:
            return [self.tokenizer.encode(first, s, add_special_tokens=True) for s in seconds]
        encodings: list[Encoding] = self.tokenizer.encode_batch([(first, s) for s in seconds], add_special_tokens=True)
        return encodings


def _sequence_ids(encoding: Encoding) -> np.ndarray:
    """Each position's sequence (0, 1), -1 for a special token."""
    return np.array([-1 if s is None else s for s in encoding.sequence_ids], dtype=np.int64)


def _kept(lengths: list[int], excess: int) -> list[int]:
    """Each sequence's content length after dropping `excess` tokens, the longest cut first."""
    kept = list(lengths)
    for _ in range(excess):
        longest = max(range(len(kept)), key=lambda i: (kept[i], -i))
        if kept[longest] == 0:
            break
        kept[longest] -= 1
    return kept


def _truncated(ids: np.ndarray, types: np.ndarray, seq: np.ndarray, max_length: int, side: str) -> np.ndarray:
    """The positions kept so that `max_length` remain, content dropped from `side`, special tokens kept."""
    keep = np.ones(len(ids), dtype=bool)
    sequences = sorted(int(s) for s in np.unique(seq) if s >= 0)
    positions = [np.flatnonzero(seq == s) for s in sequences]
    kept = _kept([len(p) for p in positions], len(ids) - max_length)
    for p, k in zip(positions, kept, strict=True):
        keep[p[k:] if side == "right" else p[: len(p) - k]] = False
    return keep


def fit(
    text: int,
    ids: np.ndarray,
    types: np.ndarray,
    seq: np.ndarray,
    max_length: int,
    policy: str,
    side: str = "right",
    overlap: int = 0,
    max_chunks: int = 1,
    field: str = "TEXT",
) -> Fitted:
    """Input `text` (its ids, type ids and each position's sequence, -1 for special tokens) as rows that
    fit `max_length`, by `policy`."""
    n = len(ids)
    if n <= max_length:
        return Fitted([Row(ids, types, text)], n, 0)
    if policy == "refuse":
        raise InvalidArgument(
            f"input '{field}' element {text}: {n} tokens, over the model's max_length of {max_length} "
            "(long_inputs refuse; truncate or chunk would take it)"
        )
    if policy == "truncate":
        keep = _truncated(ids, types, seq, max_length, side)
        return Fitted([Row(ids[keep], types[keep], text)], max_length, n - max_length)
    content = np.flatnonzero(seq >= 0)
    first, last = (int(content[0]), int(content[-1]) + 1) if len(content) else (0, n)
    head, body, tail = slice(0, first), slice(first, last), slice(last, n)
    width = max_length - first - (n - last)  # content tokens a window holds
    if width <= overlap:
        raise InvalidArgument(f"input '{field}' element {text}: windows of {width} tokens cannot overlap by {overlap}")
    step = width - overlap
    body_ids, body_types = ids[body], types[body]
    starts = list(range(0, max(1, len(body_ids) - overlap), step))
    if len(starts) > max_chunks:
        raise InvalidArgument(
            f"input '{field}' element {text}: {n} tokens make {len(starts)} windows of {max_length}, the limit is "
            f"max_chunks {max_chunks}"
        )
    rows = [
        Row(
            np.concatenate([ids[head], body_ids[s : s + width], ids[tail]]),
            np.concatenate([types[head], body_types[s : s + width], types[tail]]),
            text,
        )
        for s in starts
    ]
    return Fitted(rows, sum(len(r.ids) for r in rows), 0)


def from_encoding(encoding: Encoding) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An encoding's ids, type ids and sequence ids as arrays."""
    ids = np.array(encoding.ids, dtype=np.int64)
    types = np.array(encoding.type_ids, dtype=np.int64)
    return ids, types, _sequence_ids(encoding)
