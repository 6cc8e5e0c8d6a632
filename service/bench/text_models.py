"""`qkv bench --text-model DIR`: a text model's folder served, against what a user would run instead, in one
run on the same texts (docs/text-models.md; BENCHMARKS.md, "Text models").

- the in-process ceiling: tokenizers plus onnxruntime, texts sorted by length, the best batch size, the best
  of one session x every core and one session a core running side by side;
- sentence-transformers on the same folder's source, when its weights are given (`--text-source`);
- the server: the folder dropped in with no config, text in over v2 gRPC (the server tokenizes), at
  concurrency 1 (a 20-word text, against the in-process single call) and 32 (mixed lengths).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from service import loadgen, protocol
from service.bench.load import run_closed
from service.datatypes import encode_bytes
from service.process import start_server, stop_server

__all__ = ["mixed_texts", "text_model_bench", "text_model_table"]

BATCHES = (1, 4, 8, 16, 32)
CONCURRENCY = (1, 32)
ROOT = Path(__file__).resolve().parents[2]


def mixed_texts(count: int = 256) -> list[str]:
    """Mixed-length English: the repository's own documents, as sentences, paragraphs and runs of paragraphs."""
    paragraphs = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for block in doc.read_text(encoding="utf-8").split("\n\n"):
            words = re.sub(r"[`|#*\[\]()]", " ", block).split()
            if len(words) >= 3:
                paragraphs.append(" ".join(words))
    texts = []
    for i in range(count):
        p = paragraphs[(i * 7) % len(paragraphs)]
        if i % 10 == 9:
            texts.append(" ".join(paragraphs[(i + k * 13) % len(paragraphs)] for k in range(3)))
        elif i % 3 == 0:
            texts.append(" ".join(p.split()[:20]))
        else:
            texts.append(p)
    return texts


def _tokenizer(folder: Path, max_length: int) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return tokenizer


def _session(folder: Path, threads: int) -> Any:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    return ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])


def _run_sorted(session: Any, tokenizer: Any, texts: list[str], batch: int) -> None:
    """Tokenize, sort by length, run in batches of `batch` (what the in-process ceiling does)."""
    encodings = sorted(tokenizer.encode_batch(texts), key=lambda e: len(e.ids))
    output = session.get_outputs()[0].name
    for start in range(0, len(encodings), batch):
        part = encodings[start : start + batch]
        longest = max(len(e.ids) for e in part)
        ids = np.zeros((len(part), longest), dtype=np.int64)
        mask = np.zeros_like(ids)
        for j, e in enumerate(part):
            ids[j, : len(e.ids)], mask[j, : len(e.ids)] = e.ids, 1
        session.run([output], {"input_ids": ids, "attention_mask": mask})


def ceiling(folder: Path, texts: list[str], max_length: int) -> dict[str, Any]:
    """Texts/s in process: the best batch size, for 1 session x every core and one session a core side by side."""
    tokenizer, cores = _tokenizer(folder, max_length), len(os.sched_getaffinity(0))
    whole = _session(folder, cores)
    per_core = [_session(folder, 1) for _ in range(cores)]
    out: dict[str, Any] = {}
    for batch in BATCHES:
        t0 = time.perf_counter()
        _run_sorted(whole, tokenizer, texts, batch)
        out[f"1x{cores} b{batch}"] = len(texts) / (time.perf_counter() - t0)
        halves = [texts[i::cores] for i in range(cores)]
        jobs = zip(per_core, halves, strict=True)
        threads = [threading.Thread(target=_run_sorted, args=(s, tokenizer, h, batch)) for s, h in jobs]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out[f"{cores}x1 b{batch}"] = len(texts) / (time.perf_counter() - t0)
    best = max(out, key=out.__getitem__)
    single = " ".join(texts[0].split()[:20])
    times = []
    for _ in range(30):
        t0 = time.perf_counter()
        _run_sorted(whole, tokenizer, [single], 1)
        times.append(time.perf_counter() - t0)
    return {"texts_per_s": out[best], "best": best, "all": out, "single_p50_ms": statistics.median(times) * 1e3}


def _request(text: str, model: str) -> Any:
    req = protocol.ModelInferRequest(model_name=model)
    req.inputs.add(name="TEXT", datatype="BYTES", shape=[1])
    req.raw_input_contents.append(encode_bytes(np.array([text.encode()], dtype=object)))
    req.outputs.add(name="EMBEDDING")
    return req


def text_model_bench(folder: Path, out: Path, seconds: float = 8.0, source: Path | None = None) -> dict[str, Any]:
    """The table's figures, in one run."""
    texts = mixed_texts()
    results: dict[str, Any] = {"texts": len(texts), "seconds_per_run": seconds}
    results["ceiling"] = ceiling(folder, texts, 256)
    if source is not None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(source), device="cpu")
        model.encode(texts[:8])
        t0 = time.perf_counter()
        model.encode(texts, batch_size=32)
        results["sentence_transformers"] = {"texts_per_s": len(texts) / (time.perf_counter() - t0)}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-text-"))
    try:
        (scratch / "models" / "text").mkdir(parents=True)
        (scratch / "models" / "text" / "1").symlink_to(folder.resolve(), target_is_directory=True)
        server = start_server(["--model-repository", str(scratch / "models")], scratch / "server.log", timeout=300)
        try:
            single = " ".join(texts[0].split()[:20])
            run_closed(server.url, lambda i: (_request(texts[i % len(texts)], "text"), 0, ""), 8, 2.0, "warm-up")
            c1 = run_closed(server.url, lambda i: (_request(single, "text"), 20, ""), 1, seconds, "c1, 20 words")
            results["c1"] = loadgen.summarise(c1)
            c32 = run_closed(server.url, lambda i: (_request(texts[i % len(texts)], "text"), 0, ""), 32, seconds, "c32")
            results["c32"] = loadgen.summarise(c32)
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["c32_over_ceiling"] = results["c32"]["rps"] / results["ceiling"]["texts_per_s"]
    results["c1_p50_over_single"] = results["c1"]["p50_ms"] / results["ceiling"]["single_p50_ms"]
    (out / "text_model.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def text_model_table(r: dict[str, Any]) -> str:
    rows = [
        "| what | texts/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| in-process ceiling ({r['ceiling']['best']}) | {r['ceiling']['texts_per_s']:.1f} | "
        f"{r['ceiling']['single_p50_ms']:.2f} (one 20-word text) | |",
    ]
    if "sentence_transformers" in r:
        rows.append(f"| sentence-transformers (batch 32) | {r['sentence_transformers']['texts_per_s']:.1f} | | |")
    for c in CONCURRENCY:
        s = r[f"c{c}"]
        rows.append(f"| qkv, text in, c{c} | {s['rps']:.1f} | {s['p50_ms']:.2f} | {s['p99_ms']:.2f} |")
    rows.append(f"\nc32 / ceiling: {r['c32_over_ceiling']:.2f}; c1 p50 / in-process single call: "
                f"{r['c1_p50_over_single']:.2f}")  # fmt: skip
    return "\n".join(rows)
