"""`qkv bench --generation-model DIR`: a generation model's exported folder in qkv's engine, against optimum's
in-process `ORTModelFor...generate` on the same graphs, in one run (docs/generation.md; BENCHMARKS.md,
"Generation").

The prompts are of mixed lengths (8 to some 200 tokens, cut from the repository's documents) and greedy
answers end where the model says (EOS) or at `max_tokens`, so they end at different lengths. Measured:

- optimum batch 1, one prompt after another: output tokens/s; time to first token (a generate of one
  token) and time per output token ((a whole answer's time - the first token's) / (its tokens - 1));
- optimum static batches of 16, padded (left for a decoder-only model): output tokens/s, counting each
  row's tokens up to its EOS (a padded batch runs until its longest row ends);
- qkv, the engine the front ends stream from (the `Generator` capability, in process: no protocol in the
  way), at concurrency 1 and 16: tokens/s, TTFT p50/p99, time per output token;
- a decoder-only model: a 2,000-token prompt arriving among 15 running streams (their inter-token p99
  against their median, from its arrival to its first token and as long again), and 1,000 streams closed
  after two tokens (resident memory before and after).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import json
import os
import re
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["generation_bench", "generation_table"]

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = 64
MAX_TOKENS = 64
BATCH = 16


def _prompts(encode: Any, count: int = PROMPTS, seed: int = 0) -> list[list[int]]:
    """`count` prompts of 8 to 200 tokens, cut from the repository's documents."""
    words = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        words += re.sub(r"[`|#*\[\]()<>]", " ", doc.read_text(encoding="utf-8")).split()
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        start = int(rng.integers(0, len(words) - 400))
        ids = encode(" ".join(words[start : start + 300]))
        out.append(ids[: int(rng.integers(8, 201))])
    return out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _ends(row: list[int], eos: set[int]) -> list[int]:
    """A row's tokens up to and including its first EOS."""
    for i, t in enumerate(row):
        if t in eos:
            return row[: i + 1]
    return row


class _Optimum:
    """optimum's ORTModelFor...generate on the folder's graphs, in process, greedy."""

    def __init__(self, folder: Path, encoder_decoder: bool, eos: set[int], pad: int) -> None:
        from optimum.onnxruntime import ORTModelForCausalLM, ORTModelForSeq2SeqLM

        torch = importlib.import_module("torch")  # optimum's generate takes torch tensors (the hf extra)

        kind = ORTModelForSeq2SeqLM if encoder_decoder else ORTModelForCausalLM
        self.model = kind.from_pretrained(folder, use_cache=True)
        self.torch, self.encoder_decoder, self.eos, self.pad = torch, encoder_decoder, eos, pad

    def generate(self, rows: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(map(len, rows))
        ids = np.full((len(rows), width), self.pad, dtype=np.int64)
        mask = np.zeros((len(rows), width), dtype=np.int64)
        for i, r in enumerate(rows):
            if self.encoder_decoder:
                ids[i, : len(r)], mask[i, : len(r)] = r, 1
            else:
                ids[i, width - len(r) :], mask[i, width - len(r) :] = r, 1
        t = self.torch
        with t.no_grad():
            out = self.model.generate(input_ids=t.from_numpy(ids), attention_mask=t.from_numpy(mask),
                                      max_new_tokens=max_tokens, min_new_tokens=0, do_sample=False, num_beams=1,
                                      pad_token_id=self.pad)  # fmt: skip
        start = 1 if self.encoder_decoder else width
        return [_ends(row[start:].tolist(), self.eos) for row in out]


def _optimum(folder: Path, encoder_decoder: bool, eos: set[int], pad: int,
             prompts: list[list[int]]) -> dict[str, Any]:  # fmt: skip
    o = _Optimum(folder, encoder_decoder, eos, pad)
    o.generate(prompts[:2], 4)  # warm-up
    t0 = time.perf_counter()
    tokens = sum(len(o.generate([p], MAX_TOKENS)[0]) for p in prompts)
    batch1 = tokens / (time.perf_counter() - t0)
    firsts, per_token = [], []
    for p in prompts[:16]:
        t0 = time.perf_counter()
        o.generate([p], 1)
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        n = len(o.generate([p], MAX_TOKENS)[0])
        whole = time.perf_counter() - t0
        firsts.append(first)
        if n > 1:
            per_token.append((whole - first) / (n - 1))
    t0 = time.perf_counter()
    tokens = sum(len(r) for i in range(0, len(prompts), BATCH) for r in o.generate(prompts[i : i + BATCH], MAX_TOKENS))
    static = tokens / (time.perf_counter() - t0)
    return {"batch1_tokens_per_s": batch1, "static16_tokens_per_s": static,
            "batch1_ttft_p50_ms": statistics.median(firsts) * 1e3,
            "batch1_tpot_ms": statistics.median(per_token) * 1e3}  # fmt: skip


async def _stream(model: Any, prompt: list[int], max_tokens: int, arrivals: list[float] | None = None,
                  **fields: Any) -> tuple[float, float, int, list[float]]:  # fmt: skip
    """(TTFT, whole time, tokens, each token's arrival) of one streamed answer."""
    from service.models.generation.capability import GenerationRequest

    t0 = time.perf_counter()
    arrivals = [] if arrivals is None else arrivals
    n = 0
    async for chunk in model.generate(GenerationRequest(tuple(prompt), max_tokens, **fields)):
        arrivals.append(time.perf_counter())
        n = chunk.completion_tokens
    return arrivals[0] - t0, arrivals[-1] - t0, n, arrivals


async def _qkv(model: Any, prompts: list[list[int]], concurrency: int) -> dict[str, Any]:
    window = asyncio.Semaphore(concurrency)

    async def one(p: list[int]) -> tuple[float, float, int, list[float]]:
        async with window:
            return await _stream(model, p, MAX_TOKENS)

    t0 = time.perf_counter()
    answers = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    firsts = [a[0] for a in answers]
    per_token = [(a[1] - a[0]) / (a[2] - 1) for a in answers if a[2] > 1]
    return {"tokens_per_s": sum(a[2] for a in answers) / wall, "ttft_p50_ms": float(np.percentile(firsts, 50)) * 1e3,
            "ttft_p99_ms": float(np.percentile(firsts, 99)) * 1e3,
            "tpot_ms": statistics.median(per_token) * 1e3,
            "lengths": sorted({a[2] for a in answers})}  # fmt: skip


async def _long_prompt(model: Any, prompts: list[list[int]]) -> dict[str, Any]:
    """15 streams of 300 tokens; once each has 20, a 2,000-token prompt arrives: their inter-token gaps from
    its arrival to its first token and as long again after."""
    seen: list[list[float]] = [[] for _ in range(15)]
    streams = [asyncio.create_task(_stream(model, p, 300, seen[i], ignore_eos=True))
               for i, p in enumerate(prompts[:15])]  # fmt: skip
    while min(map(len, seen)) < 20:
        await asyncio.sleep(0.001)
    long = [t for p in prompts for t in p][:2000]
    arrived = time.perf_counter()
    first = arrived + (await _stream(model, long, 2, ignore_eos=True))[0]
    until = first + (first - arrived)
    await asyncio.gather(*streams)
    gaps = [b - a for s in seen for a, b in itertools.pairwise(s) if arrived <= b <= until]
    before = [b - a for s in seen for a, b in itertools.pairwise(s) if a >= seen[0][5] and b < arrived]
    return {
        "p99_ms": float(np.percentile(gaps, 99)) * 1e3,
        "median_ms": float(np.median(gaps)) * 1e3,
        "median_before_ms": float(np.median(before)) * 1e3,
        "gaps": len(gaps),
        "ttft_ms": (first - arrived) * 1e3,
        "p99_over_median": float(np.percentile(gaps, 99) / np.median(gaps)),
    }


async def _cancels(model: Any, prompt: list[int], count: int = 1000) -> dict[str, Any]:
    from service.models.generation.capability import GenerationRequest

    async def one() -> None:
        stream = model.generate(GenerationRequest(tuple(prompt), 100, ignore_eos=True))
        for _ in range(2):
            await anext(stream)
        await stream.aclose()

    for _ in range(50):  # the allocator's first growth, before the count
        await one()
    before = _rss()
    for i in range(0, count, 16):
        await asyncio.gather(*(one() for _ in range(min(16, count - i))))
    while model.engine.running:
        await asyncio.sleep(0.01)
    after = _rss()
    return {"cancelled": count, "rss_before_mb": before / 2**20, "rss_after_mb": after / 2**20,
            "growth": after / before - 1, "running_after": len(model.engine.running)}  # fmt: skip


def generation_bench(folder: Path, out: Path) -> dict[str, Any]:
    """The table's figures, in one run."""
    from service.models.catalog import load_checked
    from service.models.generation.model import GenerationModel

    scratch = out / "generation-model"
    version = scratch / "1"
    if not version.exists():
        version.parent.mkdir(parents=True, exist_ok=True)
        version.symlink_to(folder.resolve(), target_is_directory=True)
    model = GenerationModel(load_checked(scratch)[-1], ["CPUExecutionProvider"], None)
    model.warm_up()
    prompts = _prompts(model.encode)
    eos = set(model.defaults.eos_token_ids)
    results: dict[str, Any] = {"model": folder.name, "prompts": len(prompts), "max_tokens": MAX_TOKENS,
                               "encoder_decoder": model.is_encoder_decoder}  # fmt: skip
    results["optimum"] = _optimum(folder, model.is_encoder_decoder, eos, model.settings.pad, prompts)

    async def served() -> None:
        model.start()
        try:
            await _qkv(model, prompts[:4], 4)  # warm-up
            results["qkv_c1"] = await _qkv(model, prompts, 1)
            results["qkv_c16"] = await _qkv(model, prompts, 16)
            if not model.is_encoder_decoder and model.defaults.max_prompt_tokens >= 2000:
                results["long_prompt"] = await _long_prompt(model, prompts)
            results["cancels"] = await _cancels(model, prompts[0])
        finally:
            await model.close()

    asyncio.run(served())
    o = results["optimum"]
    best = max(o["batch1_tokens_per_s"], o["static16_tokens_per_s"])
    results["c16_over_best_optimum"] = results["qkv_c16"]["tokens_per_s"] / best
    results["c1_tpot_over_optimum_batch1"] = results["qkv_c1"]["tpot_ms"] / o["batch1_tpot_ms"]
    (out / "generation.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def generation_table(r: dict[str, Any]) -> str:
    o = r["optimum"]
    rows = [
        "| what | output tokens/s | TTFT p50 ms | TTFT p99 ms | time per output token ms |",
        "|---|---|---|---|---|",
        f"| optimum generate, batch 1, sequential | {o['batch1_tokens_per_s']:.0f} | {o['batch1_ttft_p50_ms']:.2f} | "
        f"| {o['batch1_tpot_ms']:.2f} |",
        f"| optimum generate, static padded batches of {BATCH} | {o['static16_tokens_per_s']:.0f} | | | |",
    ]
    for c in (1, 16):
        q = r[f"qkv_c{c}"]
        rows.append(f"| qkv engine, c{c} | {q['tokens_per_s']:.0f} | {q['ttft_p50_ms']:.2f} | {q['ttft_p99_ms']:.2f} "
                    f"| {q['tpot_ms']:.2f} |")  # fmt: skip
    rows.append(f"\nc16 / the better optimum: {r['c16_over_best_optimum']:.2f}; c1 time per output token / optimum "
                f"batch 1: {r['c1_tpot_over_optimum_batch1']:.2f}")  # fmt: skip
    if "long_prompt" in r:
        lp = r["long_prompt"]
        rows.append(f"2,000-token prompt among 15 streams (its first token in {lp['ttft_ms']:.0f} ms): their "
                    f"inter-token p99 {lp['p99_ms']:.2f} ms, median {lp['median_ms']:.2f} ms "
                    f"({lp['p99_over_median']:.2f} x; median before it {lp['median_before_ms']:.2f} ms)")  # fmt: skip
    c = r["cancels"]
    rows.append(
        f"{c['cancelled']} streams closed after two tokens: RSS {c['rss_before_mb']:.0f} -> "
        f"{c['rss_after_mb']:.0f} MB ({c['growth'] * 100:+.1f} %), {c['running_after']} left running"
    )
    return "\n".join(rows)
