"""The denominators of `qkv bench`'s ratios: what the models do in process, with no server.

The raw onnxruntime ceiling of g2p_encoder, its batch-1 latency with the served instance's
settings, the g2p decoding rate a word at a time and 32 together, and the kv cache's speed-up.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from service.seq2seq.graphs import session_options

__all__ = ["g2p_compute_bound", "in_process_latency", "kv_cache", "raw_ceiling"]


def _encoder_feeds(batch: int, length: int, vocab: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = rng.integers(4, vocab, size=(batch, length), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}


def raw_ceiling(model: Path, length: int, vocab: int, seconds: float = 1.5,
                batches: tuple[int, ...] = (1, 8, 32, 64)) -> dict[str, Any]:  # fmt: skip
    """Best sequences/s of in-process onnxruntime over batch sizes and sessions x threads (1x2, 2x1)."""
    rng = np.random.default_rng(0)
    table = {}
    for sessions, threads in ((1, 2), (2, 1)):
        pool = [ort.InferenceSession(str(model), session_options(threads), providers=["CPUExecutionProvider"])
                for _ in range(sessions)]  # fmt: skip
        for b in batches:
            feeds = _encoder_feeds(b, length, vocab, rng)
            pool[0].run(None, feeds)  # warm-up
            counts = [0] * sessions
            stop = time.perf_counter() + seconds

            def spin(
                k: int,
                feeds: dict[str, np.ndarray] = feeds,
                stop: float = stop,
                pool: list[ort.InferenceSession] = pool,
                counts: list[int] = counts,
            ) -> None:
                while time.perf_counter() < stop:
                    pool[k].run(None, feeds)
                    counts[k] += 1

            t0 = time.perf_counter()
            workers = [threading.Thread(target=spin, args=(k,)) for k in range(sessions)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            table[f"{sessions}x{threads} batch {b}"] = sum(counts) * b / (time.perf_counter() - t0)
    best = max(table, key=table.__getitem__)
    return {"best": table[best], "best_config": best, "table": table}


def in_process_latency(model: Path, length: int, vocab: int, n: int = 300) -> float:
    """p50 seconds of one batch-1 run with the served instance's settings (1 intra-op thread)."""
    sess = ort.InferenceSession(str(model), session_options(1), providers=["CPUExecutionProvider"])
    feeds = _encoder_feeds(1, length, vocab, np.random.default_rng(0))
    for _ in range(20):
        sess.run(None, feeds)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def g2p_compute_bound(models: Path, words: list[str], n: int = 256) -> dict[str, float]:
    """Words/s of in-process greedy decoding on one thread, a word at a time and 32 together (what
    c64 gives each of two instances): the batched / off ratio compute alone allows, before any serving
    cost. Static batches sorted by length, so an upper bound on what continuous batching gets."""
    from service.decoding.words import greedy_decode
    from service.models.g2p.model import normalize_word
    from service.seq2seq.graphs import GRAPHEMES_FILE, OnnxSeq2Seq
    from service.seq2seq.vocab import Vocabulary

    version = models / "g2p" / "1"
    graphemes, model = Vocabulary.load(version / GRAPHEMES_FILE), OnnxSeq2Seq(version, session_options(1))
    sources = [graphemes.encode(w) for w in map(normalize_word, words[:n]) if w]
    greedy_decode(model, sources[:32], 40, batch_size=32)  # warm-up
    rates = {}
    for batch in (1, 32):
        t0 = time.perf_counter()
        greedy_decode(model, sources, 40, batch_size=batch)
        rates[batch] = len(sources) / (time.perf_counter() - t0)
    return {"words_per_s_batch1": rates[1], "words_per_s_batch32": rates[32], "ratio": rates[32] / rates[1]}


def kv_cache(models: Path) -> dict[str, Any]:
    """Decoding 20 tokens, batch 32, with the kv cache vs without, in PyTorch (the export extra)."""
    try:
        from export.bench_kv import kv_cache_speedup
    except ImportError as e:  # needs torch: the export extra
        return {"skipped": f"needs the export extra: {e}"}
    card = json.loads((models / "g2p" / "config.json").read_text())["model_card"]
    return kv_cache_speedup(card["config"], steps=20)
