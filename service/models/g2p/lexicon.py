"""A pronouncing lexicon in a few flat arrays: what a g2p model version answers without decoding.

The version folder's `lexicon.txt.gz` (export/lexicon.py writes it from CMUdict: `word<TAB>PHONEMES`
a line, sorted, a word's variants in CMUdict's order) is held as
- the words' UTF-8 bytes in one blob, ordered by a 32-bit hash of each word, with their end offsets;
- the hashes themselves, sorted: a word is found by a binary search on its hash (numpy's
  `searchsorted`, all of a request's words in one call), then its bytes compared;
- each word's pronunciations, phoneme ids (one byte each) in one blob with their end offsets, and
  where each word's pronunciations end.
About 4 MB for CMUdict's 126,052 words and 135,166 pronunciations, where a dict of Python strings
would take some 25 MB; a lookup costs a hash and a slice compare.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gzip
import itertools
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["LEXICON_FILE", "Lexicon"]

LEXICON_FILE = "lexicon.txt.gz"
_MASK = 0xFFFFFFFF
HOT = 2048  # words kept with their answers (Lexicon.answers), some 0.4 MB at most


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """The indices start..start+length of each (start, length), one after another."""
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(int(ends[-1]) if len(ends) else 0)


def _trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc's malloc_trim): loading's arrays, freed, would
    otherwise stay in the process's resident memory, some 20 MB of it, never used again."""
    global _malloc_trim
    if _malloc_trim is None:
        name = ctypes.util.find_library("c") if sys.platform == "linux" else None
        try:
            _malloc_trim = ctypes.CDLL(name).malloc_trim if name else False
        except (OSError, AttributeError):  # not glibc (musl has none)
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _hash(word: str) -> int:
    """A word's 32-bit hash in this process (str hashes are salted per process: computed at load, never
    stored)."""
    return hash(word) & _MASK


class Lexicon:
    """Words -> their pronunciations (ARPAbet strings), the first one a word's answer."""

    def __init__(self, text: bytes) -> None:
        """`text`: `word<TAB>PHONEMES` lines, sorted by word (a word's variants adjacent, in their order).
        Read with numpy passes over the bytes: no Python object a line outlives its line, so loading leaves
        no garbage behind (large arrays are given back to the system when freed)."""
        if text and not text.endswith(b"\n"):
            text += b"\n"
        buf = np.frombuffer(text, dtype=np.uint8)
        line_end = np.flatnonzero(buf == 10)
        line_start = np.concatenate([[0], line_end[:-1] + 1]).astype(np.int64)
        tab = np.flatnonzero(buf == 9)
        if len(tab) != len(line_end) or np.any(tab <= line_start) or np.any(tab >= line_end - 1):
            raise ValueError("a lexicon is 'word<TAB>PHONEMES' lines, one tab in each, neither side empty")
        # A line starts a new word unless it repeats the word of the line before (a variant).
        starts, tabs = line_start.tolist(), tab.tolist()
        new_word = np.fromiter(
            (k == 0 or text[a:b] != text[starts[k - 1] : tabs[k - 1]] for k, (a, b) in enumerate(zip(starts, tabs))),  # noqa: B905
            dtype=bool,
            count=len(starts),
        )
        first_line = np.flatnonzero(new_word)
        variants = np.diff(np.append(first_line, len(starts)))
        w_start, w_len = line_start[first_line], tab[first_line] - line_start[first_line]
        hashes = np.fromiter(
            (_hash(text[a:b].decode()) for a, b in zip(w_start.tolist(), tab[first_line].tolist(), strict=True)),
            dtype=np.uint32,
            count=len(first_line),
        )
        order = np.argsort(hashes, kind="stable")  # the words ordered by hash, for the binary search
        self._hashes = hashes[order]
        self._words = buf[_ranges(w_start[order], w_len[order])].tobytes()
        self._word_ends = np.concatenate([[0], np.cumsum(w_len[order])]).astype(np.int32)
        self._variant_ends = np.concatenate([[0], np.cumsum(variants[order])]).astype(np.int32)
        # Phonemes: each token (after a tab or a space, up to a space or the line's end) as a code of its
        # 1-3 letters, numbered by the sorted codes.
        tok_start = np.flatnonzero((buf[:-1] == 9) | (buf[:-1] == 32)) + 1
        tok_end = np.flatnonzero((buf == 32) | (buf == 10))
        tok_end = tok_end[np.searchsorted(tok_end, tok_start)]
        length = tok_end - tok_start
        if len(length) and (length.min() < 1 or length.max() > 3):
            raise ValueError("a lexicon's phonemes are 1-3 letters each, one space between them")
        code = buf[tok_start].astype(np.uint32) << 16
        code |= np.where(length > 1, buf[np.minimum(tok_start + 1, len(buf) - 1)], 0).astype(np.uint32) << 8
        code |= np.where(length > 2, buf[np.minimum(tok_start + 2, len(buf) - 1)], 0).astype(np.uint32)
        codes, ids = np.unique(code, return_inverse=True)
        if len(codes) > 255:
            raise ValueError(f"a lexicon of {len(codes)} phonemes: at most 255 are held")
        self.symbols = tuple(bytes(b for b in (c >> 16, (c >> 8) & 255, c & 255) if b).decode() for c in codes.tolist())
        per_line = np.bincount(np.searchsorted(line_end, tok_start), minlength=len(starts))
        first_token = np.concatenate([[0], np.cumsum(per_line)[:-1]])
        lines = _ranges(first_line[order], variants[order])  # each word's lines, in the words' new order
        self._phones = ids.astype(np.uint8)[_ranges(first_token[lines], per_line[lines])].tobytes()
        self._pron_ends = np.concatenate([[0], np.cumsum(per_line[lines])]).astype(np.int32)
        self._hot: dict[str, tuple[int, str]] = {}  # the words asked most recently (answers)

    @classmethod
    def load(cls, path: Path) -> Lexicon:
        """The lexicon of a version folder's `lexicon.txt.gz`."""
        try:
            lexicon = cls(gzip.decompress(path.read_bytes()))
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None
        _trim_heap()
        return lexicon

    @classmethod
    def of(cls, entries: Sequence[tuple[str, str]]) -> Lexicon:
        """A lexicon of (word, pronunciation) pairs, a word's variants in their order."""
        ordered = sorted(range(len(entries)), key=lambda i: entries[i][0])
        return cls("".join(f"{entries[i][0]}\t{entries[i][1]}\n" for i in ordered).encode())

    def __len__(self) -> int:
        return len(self._hashes)

    @property
    def entries(self) -> int:
        """Its pronunciations (a word's variants each counted)."""
        return len(self._pron_ends) - 1

    @property
    def nbytes(self) -> int:
        """What its arrays hold, in bytes."""
        arrays = (self._hashes, self._word_ends, self._pron_ends, self._variant_ends)
        return len(self._words) + len(self._phones) + sum(a.nbytes for a in arrays)

    def find(self, words: Sequence[str]) -> list[int]:
        """Each word's index in the lexicon, -1 for a word it lacks: one binary search for them all."""
        if not words:
            return []
        n = len(self._hashes)
        wanted = np.fromiter((_hash(w) for w in words), dtype=np.uint32, count=len(words))
        at = np.minimum(np.searchsorted(self._hashes, wanted), max(n - 1, 0))
        hit = (self._hashes[at] == wanted).tolist() if n else [False] * len(words)
        begin, end, at_list = self._word_ends[at].tolist(), self._word_ends[at + 1].tolist(), at.tolist()
        blob, out = self._words, []
        for word, found, i, a, b in zip(words, hit, at_list, begin, end, strict=True):
            if not found:
                out.append(-1)
            elif blob[a:b] == word.encode():
                out.append(i)
            else:  # another word of the same hash: those after it
                out.append(self._scan(word, i + 1))
        return out

    def _scan(self, word: str, i: int) -> int:
        encoded, h = word.encode(), self._hashes[i - 1]
        while i < len(self._hashes) and self._hashes[i] == h:
            if self._words[self._word_ends[i] : self._word_ends[i + 1]] == encoded:
                return i
            i += 1
        return -1

    def __contains__(self, word: object) -> bool:
        return isinstance(word, str) and self.find([word])[0] >= 0

    def known(self, words: Sequence[str]) -> list[bool]:
        """Whether it holds each word (what the text rules ask, parts of words among them: not kept as
        `answers` keeps the words it is asked for)."""
        return [i >= 0 for i in self.find(words)]

    def answers(self, words: Sequence[str]) -> list[tuple[int, str]]:
        """Each word's (index, answer), (-1, "") for a word the lexicon lacks. The words asked most recently
        are kept with theirs (at most HOT of them): ordinary text asks for a few hundred words most of the
        time, and a kept one costs a dict lookup, not a search and its phonemes joined."""
        hot = self._hot
        out = [hot.get(w) for w in words]
        missing = list(dict.fromkeys(w for w, x in zip(words, out, strict=True) if x is None))
        if not missing:
            return out  # type: ignore[return-value]
        found = self.find(missing)
        listed = [i for i in found if i >= 0]
        firsts = iter(self.first(listed))
        if len(hot) + len(missing) > HOT:
            self._hot = hot = {}  # replaced whole (a reader on another thread keeps the old one)
        for w, i in zip(missing, found, strict=True):
            hot[w] = (i, next(firsts)) if i >= 0 else (-1, "")
        return [x if x is not None else hot[w] for w, x in zip(words, out, strict=True)]

    def pronunciations(self, index: int) -> list[str]:
        """The pronunciations of the word at `index` (from `find`), in the lexicon's order."""
        first, last = int(self._variant_ends[index]), int(self._variant_ends[index + 1])
        ends = self._pron_ends[first : last + 1].tolist()
        symbols = self.symbols
        return [" ".join(symbols[b] for b in self._phones[a:b]) for a, b in itertools.pairwise(ends)]

    def first(self, indices: Sequence[int]) -> list[str]:
        """The answers of the words at `indices` (from `find`, none -1): each one's first pronunciation."""
        v = self._variant_ends[np.asarray(indices, dtype=np.int64)]
        begin, end = self._pron_ends[v].tolist(), self._pron_ends[v + 1].tolist()
        symbols, phones = self.symbols, self._phones
        return [" ".join([symbols[c] for c in phones[a:b]]) for a, b in zip(begin, end, strict=True)]

    def lookup(self, word: str) -> list[str]:
        """`word`'s pronunciations; [] when the lexicon lacks it."""
        i = self.find([word])[0]
        return self.pronunciations(i) if i >= 0 else []
