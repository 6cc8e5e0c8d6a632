"""WER and PER with and without stress digits (docs/design.md, "The reference model")."""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["edit_distance", "score", "strip_stress"]


def edit_distance(a: Sequence[str], b: Sequence[str]) -> int:
    """Levenshtein distance between two symbol sequences."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def strip_stress(phonemes: Sequence[str]) -> list[str]:
    return [re.sub(r"\d", "", p) for p in phonemes]


def score(predictions: Sequence[Sequence[str]], references: Sequence[Sequence[Sequence[str]]]) -> dict[str, float]:
    """WER: share of words wrong. PER: edit distance / reference length, summed over words.

    A word with several pronunciations is scored against the closest one.
    """
    out: dict[str, float] = {}
    for name, norm in (("", list), ("_stress_free", strip_stress)):
        wrong = errors = length = 0
        for pred, refs in zip(predictions, references, strict=True):
            p = norm(pred)
            dist, ref = min((edit_distance(p, norm(r)), len(r)) for r in refs)
            wrong += dist > 0
            errors += dist
            length += ref
        out["wer" + name] = wrong / max(1, len(predictions))
        out["per" + name] = errors / max(1, length)
    out["words"] = len(predictions)
    return out
