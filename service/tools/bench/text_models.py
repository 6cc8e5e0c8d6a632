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

from service import protocol
from service.datatypes import encode_bytes
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.process import start_server, stop_server

__all__ = ["Ceiling", "mixed_texts", "text_model_bench", "text_model_table"]

BATCHES = (1, 4, 8, 16, 32)
ROUNDS = 3  # served runs at each concurrency, each between two in-process runs
CONCURRENCY = (1, 32)
ROOT = Path(__file__).resolve().parents[3]


def mixed_texts(count: int = 256, long_every: int = 10, joined: int = 3, short_words: int = 20) -> list[str]:
    """Mixed-length English: the repository's own documents, as sentences (every third text, its first
    `short_words` words), paragraphs, and every `long_every`-th text `joined` paragraphs run together."""
    paragraphs = []
    for doc in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for block in doc.read_text(encoding="utf-8").split("\n\n"):
            words = re.sub(r"[`|#*\[\]()]", " ", block).split()
            if len(words) >= 3:
                paragraphs.append(" ".join(words))
    texts = []
    for i in range(count):
        p = paragraphs[(i * 7) % len(paragraphs)]
        if i % long_every == long_every - 1:
            texts.append(" ".join(paragraphs[(i + k * 13) % len(paragraphs)] for k in range(joined)))
        elif i % 3 == 0:
            texts.append(" ".join(p.split()[:short_words]))
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


class Ceiling:
    """The in-process runs: tokenizers plus onnxruntime on one session of every core, and on one session a
    core side by side."""

    def __init__(self, folder: Path, max_length: int) -> None:
        self.tokenizer, self.cores = _tokenizer(folder, max_length), len(os.sched_getaffinity(0))
        self.whole = _session(folder, self.cores)
        self.per_core = [_session(folder, 1) for _ in range(self.cores)]

    def rate(self, texts: list[str], config: str) -> float:
        """Texts/s of `config` ("1x2 b8": one session of 2 threads, batches of 8; "2x1 b8": two of 1)."""
        sessions, batch = config.split(" b")
        t0 = time.perf_counter()
        if sessions.startswith("1x"):
            _run_sorted(self.whole, self.tokenizer, texts, int(batch))
        else:
            parts = [texts[i :: self.cores] for i in range(self.cores)]
            jobs = zip(self.per_core, parts, strict=True)
            args = [(s, self.tokenizer, part, int(batch)) for s, part in jobs]
            threads = [threading.Thread(target=_run_sorted, args=a) for a in args]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        return len(texts) / (time.perf_counter() - t0)

    def best(self, texts: list[str]) -> tuple[str, dict[str, float]]:
        """The configuration of the most texts/s, and every one's."""
        rates = {f"{s} b{b}": self.rate(texts, f"{s} b{b}") for b in BATCHES for s in ("1x2", "2x1")}
        return max(rates, key=rates.__getitem__), rates

    def single_p50_ms(self, text: str, calls: int = 30) -> float:
        """One text tokenized and run alone, the median of `calls`, on the faster of a session of every core
        and one of a core (every core loses to the threads' wake-ups on a short text, or on a busy machine)."""
        medians = []
        for session in (self.whole, self.per_core[0]):
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                _run_sorted(session, self.tokenizer, [text], 1)
                times.append(time.perf_counter() - t0)
            medians.append(statistics.median(times))
        return min(medians) * 1e3


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
    ceiling = Ceiling(folder, 256)
    best, rates = ceiling.best(texts)
    single = " ".join(texts[0].split()[:20])
    results["ceiling"] = {"best": best, "all": rates, "texts_per_s": rates[best]}
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
            run_closed(server.url, lambda i: (_request(texts[i % len(texts)], "text"), 0, ""), 8, 2.0, "warm-up")
            # Each served run is timed between two in-process runs of the same work, and compared with their
            # mean: a machine whose speed drifts (other work on it) moves both sides alike.
            for _ in range(ROUNDS):
                before = ceiling.single_p50_ms(single)
                c1 = run_closed(server.url, lambda i: (_request(single, "text"), 20, ""), 1, seconds, "c1, 20 words")
                after = ceiling.single_p50_ms(single)
                results.setdefault("c1", []).append({**loadgen.summarise(c1), "in_process_ms": (before + after) / 2})
                before = ceiling.rate(texts, best)
                make = lambda i: (_request(texts[i % len(texts)], "text"), 0, "")  # noqa: E731
                c32 = run_closed(server.url, make, 32, seconds, "c32")
                after = ceiling.rate(texts, best)
                results.setdefault("c32", []).append({**loadgen.summarise(c32), "ceiling": (before + after) / 2})
        finally:
            stop_server(server)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    results["c32_over_ceiling"] = statistics.median(r["rps"] / r["ceiling"] for r in results["c32"])
    results["c1_p50_over_single"] = statistics.median(r["p50_ms"] / r["in_process_ms"] for r in results["c1"])
    (out / "text_model.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def text_model_table(r: dict[str, Any]) -> str:
    median = statistics.median
    rows = [
        "| what | texts/s | p50 ms | p99 ms |",
        "|---|---|---|---|",
        f"| in-process ceiling ({r['ceiling']['best']}), beside each c32 run | "
        f"{median(x['ceiling'] for x in r['c32']):.1f} | | |",
        f"| in-process single call, one 20-word text, beside each c1 run | | "
        f"{median(x['in_process_ms'] for x in r['c1']):.2f} | |",
    ]
    if "sentence_transformers" in r:
        rows.append(f"| sentence-transformers (batch 32) | {r['sentence_transformers']['texts_per_s']:.1f} | | |")
    for c in CONCURRENCY:
        runs = r[f"c{c}"]
        rows.append(
            f"| qkv, text in, c{c} | {median(x['rps'] for x in runs):.1f} | {median(x['p50_ms'] for x in runs):.2f} "
            f"| {median(x['p99_ms'] for x in runs):.2f} |"
        )
    rows.append(f"\nc32 / ceiling: {r['c32_over_ceiling']:.2f}; c1 p50 / in-process single call: "
                f"{r['c1_p50_over_single']:.2f}")  # fmt: skip
    return "\n".join(rows)
