"""The load `qkv bench` sends: request makers, closed and open loops behind a progress bar.

Encoder requests of chosen lengths, g2p requests of test-split words (one or several a request),
and the latency percentiles of a run by sequence length.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from service.tools import loadgen
from service.tools.client import g2p_request

__all__ = [
    "by_length",
    "encoder_maker",
    "held_out_words",
    "run_closed",
    "run_open",
    "vocab_size",
    "word_maker",
    "words_maker",
]

ROOT = Path(__file__).resolve().parents[3]


def vocab_size(models: Path) -> int:
    """The number of graphemes g2p_encoder's token ids come from."""
    return len(json.loads((models / "g2p" / "1" / "graphemes.json").read_text()))


def held_out_words() -> list[str]:
    """The test split's words (letters and apostrophes), shuffled the same way every run."""
    path = ROOT / "export" / "data" / "split" / "test.txt"
    words = [w for w in path.read_text().split() if re.fullmatch(r"[a-z']+", w)]
    random.Random(0).shuffle(words)
    return words


def encoder_maker(lengths: Callable[[random.Random], int], vocab: int, seed: int = 0) -> loadgen.MakeRequest:
    rng, nprng = random.Random(seed), np.random.default_rng(seed)

    def make(i: int) -> tuple[Any, int, str]:
        n = lengths(rng)
        return loadgen.encoder_request(n, vocab, nprng), n, ""

    return make


def words_maker(words: list[str], per_request: int, version: str = "") -> loadgen.MakeRequest:
    def make(i: int) -> tuple[Any, int, str]:
        chunk = [words[(i * per_request + k) % len(words)] for k in range(per_request)]
        return g2p_request(chunk, version=version, lexicon=False), max(map(len, chunk)), ""  # decoded, each word

    return make


def word_maker(
    words: list[str],
    tag: Callable[[str], str] = lambda w: "",
    beam_size: int = 1,
    version: str = "",
    model: str = "g2p",
) -> loadgen.MakeRequest:
    def make(i: int) -> tuple[Any, int, str]:
        w = words[i % len(words)]
        return g2p_request([w], model, beam_size=beam_size, version=version, lexicon=False), len(w), tag(w)

    return make


def _run(coro_factory: Callable[[Callable[[int], None]], Any], label: str, total: int) -> Any:
    with tqdm(total=total, desc=label, unit="req", leave=False, dynamic_ncols=True) as bar:
        return asyncio.run(coro_factory(bar.update))


def run_closed(url: str, make: loadgen.MakeRequest, concurrency: int, seconds: float, label: str) -> loadgen.Run:
    return _run(lambda p: loadgen.closed_loop(url, make, concurrency, seconds, progress=p), label, 0)  # type: ignore[no-any-return]


def run_open(url: str, make: loadgen.MakeRequest, rate: float, seconds: float, label: str) -> loadgen.Run:
    return _run(lambda p: loadgen.open_loop(url, make, rate, seconds, progress=p), label, int(rate * seconds))  # type: ignore[no-any-return]


def by_length(run: loadgen.Run) -> dict[str, dict[str, float]]:
    """p50/p95/p99 latency (ms) of a run's OK requests, by sequence length in bands of 32."""
    edges = [4, 32, 64, 96, 128, 160, 192, 224, 257]
    table = {}
    for lo, hi in itertools.pairwise(edges):
        lat = [x.seconds for x in run.ok() if lo <= x.seq_len < hi]
        if lat:
            table[f"{lo}-{hi - 1}"] = {q: float(np.percentile(lat, int(q[1:]))) * 1e3 for q in ("p50", "p95", "p99")}
    return table
