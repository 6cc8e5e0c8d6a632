"""Token vocabularies shared by training (export/) and serving: a list of symbols with specials first."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["BOS", "EOS", "PAD", "SPECIALS", "UNK", "Vocabulary"]

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)  # ids 0..3 in every vocabulary


class Vocabulary:
    """Symbol <-> id. Ids 0-3 are the specials, so pad_id == 0 everywhere."""

    pad_id, bos_id, eos_id, unk_id = 0, 1, 2, 3

    def __init__(self, symbols: Sequence[str]) -> None:
        if tuple(symbols[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"a vocabulary starts with {SPECIALS}")
        self.symbols = list(symbols)
        self.index = {s: i for i, s in enumerate(self.symbols)}

    @classmethod
    def build(cls, symbols: Iterable[str]) -> Vocabulary:
        return cls([*SPECIALS, *sorted(set(symbols) - set(SPECIALS))])

    @classmethod
    def load(cls, path: Path) -> Vocabulary:
        return cls(json.loads(Path(path).read_text()))

    def save(self, path: Path) -> None:
        Path(path).write_text(json.dumps(self.symbols, indent=0) + "\n")

    def __len__(self) -> int:
        return len(self.symbols)

    def __contains__(self, symbol: str) -> bool:
        return symbol in self.index

    def encode(self, symbols: Iterable[str]) -> list[int]:
        return [self.index.get(s, self.unk_id) for s in symbols]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Ids up to the first end-of-sequence, specials dropped."""
        out = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= len(SPECIALS):
                out.append(self.symbols[i])
        return out
