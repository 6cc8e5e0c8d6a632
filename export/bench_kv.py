"""Decoding with the key/value cache versus recomputing the prefix, in one run (PyTorch).

Speed does not depend on the weights' values, so a model of the shipped configuration with
fresh weights gives the shipped model's ratio; no checkpoint is needed.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from export.model import DecoderStep, EncoderGraph, TransformerConfig, make_model, subsequent_mask
from service.seq2seq.graphs import step_arrays

__all__ = ["kv_cache_speedup"]


@torch.inference_mode()
def kv_cache_speedup(config: dict[str, Any], steps: int = 20, batch: int = 32, source: int = 10,
                     repeats: int = 5) -> dict[str, Any]:  # fmt: skip
    torch.set_num_threads(2)
    c = TransformerConfig(**config)
    model = make_model(c).eval()
    ids = torch.randint(4, c.src_vocab, (batch, source))
    mask = torch.ones_like(ids)
    _, ck, cv = EncoderGraph(model)(ids, mask)
    memory = model.encode(ids, mask.bool()[:, None, None, :])
    step = DecoderStep(model)

    def cached() -> None:
        cache_k = torch.zeros(c.n_decoder, batch, c.h, steps, c.d_k)
        cache_v = cache_k.clone()
        cache_mask = torch.zeros(batch, steps, dtype=torch.int64)
        tokens = torch.ones(batch, dtype=torch.int64)
        for t in range(steps):
            args = step_arrays(tokens, torch.full((batch,), t), cache_k, cache_v, cache_mask, ck, cv, mask)
            logp, new_k, new_v, _ = step(*args)
            cache_k[:, :, :, t], cache_v[:, :, :, t], cache_mask[:, t] = new_k, new_v, 1
            tokens = logp.argmax(-1)

    def recomputed() -> None:
        prefix = torch.ones(batch, 1, dtype=torch.int64)
        src_mask = mask.bool()[:, None, None, :]
        for _ in range(steps):
            states = model.decode(memory, src_mask, prefix, subsequent_mask(prefix.size(1))[:, None])
            nxt = model.generator(states[:, -1]).argmax(-1)
            prefix = torch.cat([prefix, nxt[:, None]], dim=1)

    def best(fn: Any) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    with_cache, without = best(cached), best(recomputed)
    return {
        "steps": steps,
        "batch": batch,
        "with_cache_ms": with_cache * 1e3,
        "without_cache_ms": without * 1e3,
        "speedup": without / with_cache,
    }
