"""`qkv bench --text-model DIR`: a text model's folder served, against what a user would run instead, in one
run on the same texts (docs/text-models.md; BENCHMARKS.md, "Text models").

- the in-process ceiling: tokenizers plus onnxruntime, texts sorted by length, the best batch size, the best
  of one session x every core and one session a core running side by side;
- sentence-transformers on the same folder's source, when its weights are given (`--text-source`);
- infinity-emb on its ONNX engine (optimum), from its own environment (service/bench/peers/envs.py), over
  its OpenAI-style HTTP API, beside qkv's own `/v1/embeddings` driven by the same client, when the source
  is given (it serves optimum's transformers export of it: its engine reads `last_hidden_state`);
- the server: the folder dropped in with no config, text in over v2 gRPC (the server tokenizes), at
  concurrency 1 (a 20-word text, against the in-process single call) and 32 (mixed lengths).

Every text is cut at 256 tokens beforehand (at a token's end), so that every system runs the same tokens
whatever its own rule: infinity-emb's engine cuts at the config's 512 positions, the others at
sentence-transformers' max_seq_length of 256.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from service import protocol
from service.datatypes import encode_bytes
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.bench.peers.envs import ensure, freeze
from service.tools.bench.peers.launch import Peer, start_peer, stop_peer, wait_http_ready
from service.tools.process import ServerProcess, start_server, stop_server

__all__ = ["Ceiling", "cut_texts", "http_closed_loop", "mixed_texts", "text_model_bench", "text_model_table"]

BATCHES = (1, 4, 8, 16, 32)
ROUNDS = 3  # served runs at each concurrency, each between two in-process runs
CONCURRENCY = (1, 32)
MAX_TOKENS = 256  # every text is cut at this many tokens beforehand
ROOT = Path(__file__).resolve().parents[3]


def mixed_texts(count: int = 256, long_every: int = 10, joined: int = 3, short_words: int = 20,
                most_words: int | None = None) -> list[str]:  # fmt: skip
    """Mixed-length English: the repository's own documents, as sentences (every third text, its first
    `short_words` words), paragraphs, and every `long_every`-th text `joined` paragraphs run together; with
    `most_words`, each text at most its first that many words (the same texts, short)."""
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
    return texts if most_words is None else [" ".join(t.split()[:most_words]) for t in texts]


def _tokenizer(folder: Path, max_length: int | None) -> Any:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()
    if max_length is None:
        tokenizer.no_truncation()
    else:
        tokenizer.enable_truncation(max_length)
    return tokenizer


def cut_texts(texts: list[str], tokenizer: Any, tokens: int) -> list[str]:
    """Each text cut at the end of its last token within `tokens` (special tokens counted), by the
    tokenizer's character offsets; a shorter text as it is. `tokenizer` must not truncate."""
    out = []
    for text, e in zip(texts, tokenizer.encode_batch(texts), strict=True):
        content = [end for (_, end), special in zip(e.offsets, e.special_tokens_mask, strict=True) if not special]
        keep = tokens - (len(e.ids) - len(content))
        out.append(text if len(content) <= keep else text[: content[keep - 1]])
    return out


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

    def embed(self, texts: list[str]) -> np.ndarray:
        """The graph's pooled output for `texts`, one at a time (what other servers' answers are held to)."""
        (name,) = [o.name for o in self.whole.get_outputs() if o.name == "sentence_embedding"]
        rows = []
        for e in self.tokenizer.encode_batch(texts):
            ids = np.array([e.ids], dtype=np.int64)
            rows.append(self.whole.run([name], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0][0])
        return np.array(rows)

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


async def _http_closed(url: str, path: str, body: Callable[[int], dict[str, Any]], concurrency: int,
                       seconds: float) -> loadgen.Run:  # fmt: skip
    run = loadgen.Run()
    cpu0, t0 = loadgen.own_cpu(), time.perf_counter()
    stop, counter = t0 + seconds, itertools.count()
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency), timeout=timeout) as session:

        async def worker() -> None:
            while True:  # one request at least, as loadgen's closed loop
                data = body(next(counter))
                s0 = time.perf_counter()
                try:
                    async with session.post(f"http://{url}{path}", json=data) as r:
                        await r.read()
                        code = "OK" if r.status == 200 else f"HTTP_{r.status}"
                except (aiohttp.ClientError, TimeoutError) as e:
                    code = type(e).__name__
                run.samples.append(loadgen.Sample(0, time.perf_counter() - s0, code))
                if time.perf_counter() >= stop:
                    return

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    run.wall, run.client_cpu = time.perf_counter() - t0, loadgen.own_cpu() - cpu0
    return run


def http_closed_loop(url: str, path: str, body: Callable[[int], dict[str, Any]], concurrency: int,
                     seconds: float) -> loadgen.Run:  # fmt: skip
    """A closed loop of OpenAI-style JSON posts (`body(i)` the i-th), the one HTTP client both servers get."""
    return asyncio.run(_http_closed(url, path, body, concurrency, seconds))


def _rows_per_run(server: ServerProcess) -> tuple[int, int]:
    """(rows, runs) the served model has computed: its v2 statistics' inference and execution counts."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/text/stats", timeout=30) as r:
        s = json.loads(r.read())["model_stats"][0]
    return int(s["inference_count"]), int(s["execution_count"])


def _transformers_export(python: Path, source: Path) -> Path:
    """`source` exported by optimum for transformers (output `last_hidden_state`), with the peer's own
    optimum-cli, once, beside its environment. infinity-emb's ONNX engine reads that output: the
    sentence-transformers export's (`token_embeddings`, `sentence_embedding`) fails it at its warm-up with
    KeyError: 'last_hidden_state'. The graph is the same model less the pooling, which infinity-emb does."""
    key = hashlib.sha256(str(source.resolve()).encode()).hexdigest()[:10]
    folder = python.parents[1] / f"export-{key}"
    if (folder / "model.onnx").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    cli = ["optimum-cli", "export", "onnx", "--task", "feature-extraction", "--library-name", "transformers"]
    subprocess.run([str(python), str(python.parent / cli[0]), *cli[1:], "--model", str(source), str(partial)],
                   check=True, capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    partial.rename(folder)
    return folder


def _start_infinity(source: Path, scratch: Path, cores: int) -> tuple[Peer | None, dict[str, Any]]:
    """infinity-emb serving `source`, or None and why not (the bench goes on without it)."""
    try:
        python = ensure("infinity")
        export = _transformers_export(python, source)
    except (subprocess.CalledProcessError, OSError) as e:
        output = getattr(e, "stderr", b"") or b""
        return None, {"skipped": f"could not be installed or exported: {e} {output.decode(errors='replace')[-2000:]}"}
    peer = start_peer("infinity", python, export, "text", scratch, cores)
    try:
        wait_http_ready(peer.url, "/embeddings", {"model": "text", "input": ["warm up"]},
                        lambda: peer.process.poll() is None)  # fmt: skip
    except RuntimeError as e:
        stop_peer(peer)
        return None, {"skipped": f"did not serve: {e}: {peer.output()[-2000:]}"}
    return peer, {"freeze": freeze(python), "engine": "optimum (onnxruntime)", "export": "optimum, transformers"}


def _pause(peer: Peer, stop: bool) -> None:
    """Stop (SIGSTOP) or continue infinity-emb's processes between its own runs: idle, its batching loop polls,
    some 60 % of a core taken from whatever else is measured."""
    os.killpg(peer.process.pid, signal.SIGSTOP if stop else signal.SIGCONT)


def _embeddings(url: str, path: str, texts: list[str]) -> np.ndarray:
    data = json.dumps({"model": "text", "input": texts}).encode()
    request = urllib.request.Request(f"http://{url}{path}", data, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        return np.array([d["embedding"] for d in json.loads(r.read())["data"]], dtype=np.float32)


def _min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return float((a * b).sum(axis=1).min())


def text_model_bench(folder: Path, out: Path, seconds: float = 8.0, source: Path | None = None,
                     words: int | None = None) -> dict[str, Any]:  # fmt: skip
    """The table's figures, in one run; with `words`, on the same texts cut to their first `words` words."""
    texts = cut_texts(mixed_texts(most_words=words), _tokenizer(folder, None), MAX_TOKENS)
    tokens = [len(e.ids) for e in _tokenizer(folder, MAX_TOKENS).encode_batch(texts)]
    results: dict[str, Any] = {"texts": len(texts), "seconds_per_run": seconds, "mean_tokens": float(np.mean(tokens)),
                               "most_words": words}  # fmt: skip
    ceiling = Ceiling(folder, MAX_TOKENS)
    best, rates = ceiling.best(texts[::2])  # the search on half the texts, its best timed on all beside each run
    single = " ".join(texts[0].split()[:20])
    results["single_tokens"] = len(ceiling.tokenizer.encode(single).ids)
    results["ceiling"] = {"best": best, "all": rates}
    if source is not None:
        from sentence_transformers import SentenceTransformer

        model = SentenceTransformer(str(source), device="cpu")
        model.encode(texts[:8])
        t0 = time.perf_counter()
        model.encode(texts, batch_size=32)
        results["sentence_transformers"] = {"texts_per_s": len(texts) / (time.perf_counter() - t0)}
    else:
        results["infinity"] = {"skipped": "no --text-source: infinity-emb serves the source's own export"}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-text-"))
    peer: Peer | None = None
    try:
        (scratch / "models" / "text").mkdir(parents=True)
        (scratch / "models" / "text" / "1").symlink_to(folder.resolve(), target_is_directory=True)
        server = start_server(["--model-repository", str(scratch / "models")], scratch / "server.log", timeout=300)
        if source is not None:
            peer, results["infinity"] = _start_infinity(source, scratch, ceiling.cores)
        try:
            run_closed(server.url, lambda i: (_request(texts[i % len(texts)], "text"), 0, ""), 8, 2.0, "warm-up")
            check = texts[:: len(texts) // 8]
            results["qkv_cosine"] = _min_cosine(_embeddings(server.http_url, "/v1/embeddings", check),
                                                ceiling.embed(check))  # fmt: skip
            if peer is not None:
                results["infinity"]["cosine"] = _min_cosine(_embeddings(peer.url, "/embeddings", check),
                                                            ceiling.embed(check))  # fmt: skip
                _pause(peer, True)
            _rounds(results, server, peer, ceiling, texts, single, best, seconds)
        finally:
            stop_server(server)
            # what the start chose and timed (the batching, the longest text computed on the event loop)
            results["log"] = [line for line in server.log.read_text().splitlines() if "model 'text'" in line]
    finally:
        if peer is not None:
            _pause(peer, False)
            stop_peer(peer)
        shutil.rmtree(scratch, ignore_errors=True)
    results["c32_over_ceiling"] = statistics.median(r["rps"] / r["ceiling"] for r in results["c32"])
    results["c1_p50_over_single"] = statistics.median(r["p50_ms"] / r["in_process_ms"] for r in results["c1"])
    if "c32" in results.get("infinity", {}):
        results["http_c32_over_infinity"] = statistics.median(
            q["rps"] / i["rps"] for q, i in zip(results["http_c32"], results["infinity"]["c32"], strict=True)
        )
    (out / "text_model.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def _rounds(results: dict[str, Any], server: ServerProcess, peer: Peer | None, ceiling: Ceiling, texts: list[str],
            single: str, best: str, seconds: float) -> None:  # fmt: skip
    """ROUNDS rounds: each served run timed between two in-process runs of the same work and compared with their
    mean (a machine whose speed drifts, other work on it, moves both sides alike); then qkv's HTTP front end
    and infinity-emb, one after the other, driven by the same HTTP client, infinity-emb stopped outside its
    own runs."""
    mixed = lambda i: {"model": "text", "input": texts[i % len(texts)]}  # noqa: E731
    for _ in range(ROUNDS):
        before = ceiling.single_p50_ms(single)
        c1 = run_closed(server.url, lambda i: (_request(single, "text"), 20, ""), 1, seconds, "c1, 20 words")
        after = ceiling.single_p50_ms(single)
        results.setdefault("c1", []).append({**loadgen.summarise(c1), "in_process_ms": (before + after) / 2})
        before = ceiling.rate(texts, best)
        rows0, runs0 = _rows_per_run(server)
        make = lambda i: (_request(texts[i % len(texts)], "text"), 0, "")  # noqa: E731
        c32 = run_closed(server.url, make, 32, seconds, "c32")
        rows1, runs1 = _rows_per_run(server)
        after = ceiling.rate(texts, best)
        results.setdefault("c32", []).append({**loadgen.summarise(c32), "ceiling": (before + after) / 2,
                                              "rows_per_run": (rows1 - rows0) / max(1, runs1 - runs0)})  # fmt: skip
        if peer is None:
            continue
        http = http_closed_loop(server.http_url, "/v1/embeddings", mixed, 32, seconds)
        results.setdefault("http_c32", []).append(loadgen.summarise(http))
        inf = results["infinity"]
        _pause(peer, False)
        one = http_closed_loop(peer.url, "/embeddings", lambda i: {"model": "text", "input": single}, 1, seconds)
        inf.setdefault("c1", []).append(loadgen.summarise(one))
        many = http_closed_loop(peer.url, "/embeddings", mixed, 32, seconds)
        _pause(peer, True)
        inf.setdefault("c32", []).append(loadgen.summarise(many))


def text_model_table(r: dict[str, Any]) -> str:
    median = statistics.median
    mean_tokens, single_tokens = r["mean_tokens"], r["single_tokens"]

    def row(what: str, runs: list[dict[str, Any]], tokens: float) -> str:
        rps = median(x["rps"] for x in runs)
        return (f"| {what} | {rps:.1f} | {rps * tokens:.0f} | {median(x['p50_ms'] for x in runs):.2f} "
                f"| {median(x['p99_ms'] for x in runs):.2f} |")  # fmt: skip

    ceiling = median(x["ceiling"] for x in r["c32"])
    rows = [
        "| what | texts/s | tokens/s | p50 ms | p99 ms |",
        "|---|---|---|---|---|",
        f"| in-process ceiling ({r['ceiling']['best']}), beside each c32 run | {ceiling:.1f} "
        f"| {ceiling * mean_tokens:.0f} | | |",
        f"| in-process single call, one 20-word text, beside each c1 run | | | "
        f"{median(x['in_process_ms'] for x in r['c1']):.2f} | |",
    ]
    if "sentence_transformers" in r:
        st = r["sentence_transformers"]["texts_per_s"]
        rows.append(f"| sentence-transformers (batch 32) | {st:.1f} | {st * mean_tokens:.0f} | | |")
    rows.append(row("qkv, v2 gRPC, text in, c1", r["c1"], single_tokens))
    rows.append(row("qkv, v2 gRPC, text in, c32", r["c32"], mean_tokens))
    infinity = r.get("infinity", {})
    if "c32" in infinity:
        rows.append(row("qkv, OpenAI HTTP /v1/embeddings, c32", r["http_c32"], mean_tokens))
        rows.append(row("infinity-emb (optimum), OpenAI HTTP /embeddings, c1", infinity["c1"], single_tokens))
        rows.append(row("infinity-emb (optimum), OpenAI HTTP /embeddings, c32", infinity["c32"], mean_tokens))
    said = [
        f"\nc32 / ceiling: {r['c32_over_ceiling']:.2f}; c1 p50 / in-process single call: "
        f"{r['c1_p50_over_single']:.2f}; mean rows per run at c32: {median(x['rows_per_run'] for x in r['c32']):.1f}"
    ]
    said.append(
        f"texts: {r['texts']}, {mean_tokens:.1f} tokens on average"
        + (f", each at most {r['most_words']} words" if r.get("most_words") else "")
    )
    if "http_c32_over_infinity" in r:
        said.append(f"qkv HTTP c32 / infinity-emb c32: {r['http_c32_over_infinity']:.2f}")
    elif "skipped" in infinity:
        said.append(f"infinity-emb not measured: {infinity['skipped']}")
    return "\n".join(rows + said)
