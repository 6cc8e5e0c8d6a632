# Over 500 lines: one bench section whole (text through g2p): its corpus, runs and tables.
"""`qkv bench --text`: g2p on English text as people write it, with the response cache on and off.

Real traffic (a text-to-speech front end) is text, where a few hundred words make up half of all
tokens, not words drawn uniformly from a dictionary. This replays a corpus one sentence a request:
Debian's `fortunes` package by default (`%`-separated quotes under /usr/share/games/fortunes), or
`--text-file PATH` (such a file, plain text, or a directory of them).

Two servers on copies of the repository, the same settings but g2p's `response_cache`, take turns in
alternating slices at concurrency 1, 16 and 64, so that their ratio compares the same seconds; each
reads the corpus from its own place onwards (the cache server starts cold and warms as it reads).
Before that, every sentence the model may not be able to spell as written is sent once to the
cache-off server (one decoding step a word): refused, it is sent again without the words the model
cannot spell, and refused again, counted and left out. Last, on the cache server, one connection
alternates sentences whose every word is kept with ModelReady, the bare gRPC round trip. Every request
asks `lexicon: false`: what is measured is the decoder and its response cache, as before g2p had a
pronouncing lexicon (which would answer most of the corpus's words without either).

`qkv bench --lexicon`: on one server, a request of 64 words the lexicon holds against the same words
all kept by the response cache (`lexicon: false`), taken in turns on one connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from service import protocol
from service.errors import UsageError
from service.models.g2p.model import normalize_word
from service.models.g2p.text import spoken_words
from service.repository.layout import available_versions
from service.tools import loadgen
from service.tools.bench.load import run_closed
from service.tools.bench.sections import THROUGHPUT_QUEUE_WAIT_MS
from service.tools.bench.servers import Servers
from service.tools.client import g2p_request
from service.tools.process import ServerProcess

__all__ = [
    "FORTUNES",
    "LEXICON_WORDS",
    "corpus_files",
    "frequency_curve",
    "lexicon_bench",
    "lexicon_table",
    "read_sentences",
    "text_bench",
    "text_table",
]

FORTUNES = Path("/usr/share/games/fortunes")
CONCURRENCY = (1, 16, 64)
SLICES = 4  # each server's time at a concurrency, cut into this many slices taken in turns
TOPS = (10, 100, 1000)
SERVERS = ("cache on", "cache off")


def corpus_files(text_file: Path | None = None) -> list[Path]:
    """The files to read: `text_file` (a file, or a directory of them), or the fortunes package's;
    a UsageError saying how to get them when there are none."""
    where = text_file or FORTUNES
    if not where.exists():
        if text_file is None:
            raise UsageError(
                f"--text: no corpus at {FORTUNES}: install Debian's fortunes (apt-get install -y fortunes) "
                "or give --text-file PATH (%-separated quotes, or plain text)"
            )
        raise UsageError(f"--text-file not found: {text_file}")
    if where.is_file():
        return [where]
    # fortune's own files: no suffix (NAME.dat is its index, NAME.u8 a link to NAME)
    files = sorted(p for p in where.iterdir() if p.is_file() and not p.is_symlink() and not p.suffix)
    if not files:
        raise UsageError(f"{'--text-file' if text_file else '--text'}: no text file in {where}")
    return files


_QUOTE_END = re.compile(r"^%\s*$", re.MULTILINE)
_OVERSTRIKE = re.compile(r".\x08")  # nroff's bold and underline (c BACKSPACE c): the letter stays
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def read_sentences(paths: list[Path]) -> list[list[str]]:
    """Each quote (text between `%` lines; a file without them is one) as its sentences, as written:
    lines joined, split after . ! or ? where a capital or a digit begins the next."""
    quotes = []
    for path in paths:
        text = _OVERSTRIKE.sub("", path.read_text(encoding="utf-8", errors="replace"))
        for quote in _QUOTE_END.split(text):
            sentences = [s for s in _SENTENCE_END.split(" ".join(quote.split())) if s]
            if sentences:
                quotes.append(sentences)
    return quotes


def words_of(text: str) -> list[str]:
    """The words the server reads `text` as (g2p's text rules, service/models/g2p/text.py)."""
    return spoken_words(text)


def frequency_curve(words: list[str], tops: tuple[int, ...] = TOPS) -> dict[str, float]:
    """The share of all tokens that the N most frequent words cover, for each N in `tops`."""
    counts = sorted(Counter(words).values(), reverse=True)
    total = sum(counts) or 1
    return {f"top {n}": sum(counts[:n]) / total for n in tops}


@dataclass
class Vetted:
    """What the corpus's sentences became: the texts sent, and how many got there which way."""

    texts: list[str] = field(default_factory=list)
    as_written: int = 0
    stripped: int = 0  # sent without the words the model could not spell, refused as written
    refused: int = 0  # refused even so: left out
    no_words: int = 0  # punctuation or pictures only: nothing to convert
    reasons: Counter[str] = field(default_factory=Counter)  # the refusals' messages, numbers and quotes as ...


NOTHING_LEFT = "refused as written, and no word the model can spell in it (numbers, symbols)"


class Spelling:
    """What the served g2p version can spell, from its graphemes.json and config.json's limits."""

    def __init__(self, models: Path) -> None:
        newest = max(available_versions(models / "g2p"))
        self.graphemes = set(json.loads((models / "g2p" / str(newest) / "graphemes.json").read_text()))
        limits = json.loads((models / "g2p" / "config.json").read_text()).get("limits", {})
        self.max_word_length = int(limits.get("max_word_length", 32))
        self.max_words = int(limits.get("max_words", 64))

    def word(self, w: str) -> bool:
        return len(w) <= self.max_word_length and all(c in self.graphemes for c in w)

    def sentence(self, text: str) -> bool:
        words = words_of(text)
        return len(words) <= self.max_words and all(map(self.word, words))

    def strip(self, text: str) -> str:
        """`text` without the tokens holding a word the model cannot spell (punctuation alone stays)."""
        return " ".join(t for t in text.split() if not (w := normalize_word(t)) or self.word(w))


def vet(url: str, sentences: list[str], spelling: Spelling, concurrency: int = 8) -> Vetted:
    """Each sentence as it will be sent. Those `spelling` doubts are sent as written (one decoding step
    a word); refused, without the words the model cannot spell; refused again, counted and left out."""
    out = Vetted()
    doubtful = {i: s for i, s in enumerate(sentences) if words_of(s) and not spelling.sentence(s)}
    first = dict(zip(doubtful, asyncio.run(_refusals(url, list(doubtful.values()), concurrency)), strict=True))
    retry = {i: spelling.strip(doubtful[i]) for i, why in first.items() if why}
    retry = {i: s for i, s in retry.items() if words_of(s)}
    second = dict(zip(retry, asyncio.run(_refusals(url, list(retry.values()), concurrency)), strict=True))
    for i, s in enumerate(sentences):
        if not words_of(s):
            out.no_words += 1
        elif not first.get(i):
            out.texts.append(s)
            out.as_written += 1
        elif i in retry and not second[i]:
            out.texts.append(retry[i])
            out.stripped += 1
        else:
            out.refused += 1
            why = second[i] if i in retry else NOTHING_LEFT
            out.reasons[re.sub(r"'[^']*'|\(U\+[0-9A-F]+\)|\d+", "...", why)] += 1
    return out


BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)  # the server's state, not the text's


async def _refusals(url: str, texts: list[str], concurrency: int) -> list[str]:
    """For each text sent alone to g2p with max_output_length 1: "" when answered, else the refusal
    (an overloaded server's is no verdict on the text: sent again)."""
    verdicts = [""] * len(texts)
    todo = iter(range(len(texts)))
    async with grpc.aio.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)

        async def worker() -> None:
            for i in todo:
                request = g2p_request([texts[i]])
                request.parameters["max_output_length"].int64_param = 1  # accepted or not: one step enough
                while True:
                    try:
                        await stub.ModelInfer(request, timeout=60)
                    except grpc.aio.AioRpcError as e:
                        if e.code() in BUSY:
                            await asyncio.sleep(0.1)
                            continue
                        verdicts[i] = f"{e.code().name}: {e.details()}"
                    break

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return verdicts


@dataclass
class Reader:
    """One server's way through the texts: where it is, what it sent in the current cell."""

    server: ServerProcess
    at: int = 0
    sent: list[int] = field(default_factory=list)

    def maker(self, texts: list[str], words: list[list[str]], built: dict[int, Any]) -> loadgen.MakeRequest:
        start = self.at

        def make(i: int) -> tuple[Any, int, str]:
            k = (start + i) % len(texts)
            self.sent.append(k)
            if k not in built:
                built[k] = g2p_request([texts[k]], lexicon=False)
            return built[k], len(words[k]), ""  # seq_len: the request's words

        return make


def _one_step_maker(texts: list[str]) -> loadgen.MakeRequest:
    """Requests decoding one step a word: the scheduler and sessions warm, no answer the bench asks for kept
    (max_output_length is part of a kept word's key)."""
    requests = [g2p_request([t], lexicon=False) for t in texts]
    for request in requests:
        request.parameters["max_output_length"].int64_param = 1
    return lambda i: (requests[i % len(requests)], 1, "")


def _cache_counts(url: str) -> tuple[int, int]:
    """g2p's (cache hits, cache misses) so far, words looked up (ModelStatistics; 0, 0 without a cache)."""
    with grpc.insecure_channel(url) as channel:
        s = protocol.Stub(channel).ModelStatistics(protocol.ModelStatisticsRequest(name="g2p"), timeout=10)
    i = s.model_stats[0].inference_stats
    return i.cache_hit.count, i.cache_miss.count


def text_bench(
    models: Path, out: Path, seconds: float = 8.0, text_file: Path | None = None, seed: int = 0
) -> dict[str, Any]:
    """The corpus's facts, its vetting, then per server and concurrency words/s, request p50/p99, the
    distinct share of the words sent and the cache hit rate; then all-kept sentences vs ModelReady."""
    files = corpus_files(text_file)
    quotes = read_sentences(files)
    random.Random(seed).shuffle(quotes)  # documents in a mixed order, each one's sentences in theirs
    sentences = [s for q in quotes for s in q]
    corpus_words = [w for s in sentences for w in words_of(s)]
    results: dict[str, Any] = {
        "model": "g2p",
        "seconds_per_cell": seconds,
        "slices": SLICES,
        "load_average_before": os.getloadavg(),
        "corpus": {
            "files": [str(f) for f in files],
            "quotes": len(quotes),
            "sentences": len(sentences),
            "words": len(corpus_words),
            "distinct_words": len(set(corpus_words)),
            "curve": frequency_curve(corpus_words),
        },
    }
    scratch = Path(tempfile.mkdtemp(prefix="qkv-text-"))
    servers = Servers(models, scratch)
    same = {
        "batching": {"max_queue_wait_ms": THROUGHPUT_QUEUE_WAIT_MS},
        "version_policy": {"latest": {"num_versions": 1}},
    }
    try:
        on = servers.start({"g2p": {**same, "response_cache": {"enable": True}}})
        off = servers.start({"g2p": same})
        vetted = vet(off.url, sentences, Spelling(models))
        results["vetting"] = {
            "as_written": vetted.as_written,
            "stripped": vetted.stripped,
            "refused": vetted.refused,
            "no_words": vetted.no_words,
            "reasons": dict(vetted.reasons.most_common()),
        }
        if not vetted.texts:
            raise UsageError("--text: no sentence of the corpus could be sent (see the reasons in text.json)")
        texts = vetted.texts
        words = [words_of(t) for t in texts]
        built: dict[int, Any] = {}
        readers = {"cache on": Reader(on), "cache off": Reader(off)}
        for name, r in readers.items():
            run_closed(r.server.url, _one_step_maker(texts[-64:]), 16, 1.0, f"warm-up {name}")
        for c in CONCURRENCY:
            results.update(_cell(readers, texts, words, built, c, seconds))
        read = texts[: min(readers["cache on"].at, 500)] or texts[:1]  # what the cache server has read
        results["all_kept"] = all_kept_round_trips(on.url, read, pairs=max(50, int(125 * seconds)))
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return _record(results, out, "text", text_table)


def _record(results: dict[str, Any], out: Path, name: str, table: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """`results`, with the load average now, written as out/NAME.json and their table as out/NAME.md."""
    results["load_average_after"] = os.getloadavg()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2, default=float))
    (out / f"{name}.md").write_text(table(results) + "\n")
    return results


def _cell(
    readers: dict[str, Reader],
    texts: list[str],
    words: list[list[str]],
    built: dict[int, Any],
    concurrency: int,
    seconds: float,
) -> dict[str, Any]:
    """Both servers at one concurrency, in SLICES alternating slices (the order flipped each slice)."""
    runs = {name: loadgen.Run() for name in readers}
    slices: dict[str, list[dict[str, Any]]] = {name: [] for name in readers}
    sent: dict[str, list[int]] = {name: [] for name in readers}
    hits = dict.fromkeys(readers, 0)
    misses = dict.fromkeys(readers, 0)
    pairs: list[float] = []
    for k in range(SLICES):
        order = list(readers) if k % 2 == 0 else list(reversed(readers))
        rates = {}
        for name in order:
            r = readers[name]
            h0, m0 = _cache_counts(r.server.url)
            r.sent = []
            label = f"{name} c{concurrency} {k + 1}/{SLICES}"
            run = run_closed(r.server.url, r.maker(texts, words, built), concurrency, seconds / SLICES, label)
            h1, m1 = _cache_counts(r.server.url)
            hits[name] += h1 - h0
            misses[name] += m1 - m0
            r.at += len(r.sent)
            sent[name] += r.sent
            runs[name].add(run)
            slices[name].append({**loadgen.summarise(run), "hits": h1 - h0, "misses": m1 - m0})
            rates[name] = sum(x.seq_len for x in run.ok()) / run.wall
        if rates["cache off"]:
            pairs.append(rates["cache on"] / rates["cache off"])
    cells = {}
    for name, run in runs.items():
        summary = loadgen.summarise(run)
        sent_words = [w for k in sent[name] for w in words[k]]
        looked_up = hits[name] + misses[name]
        cells[f"{name} c{concurrency}"] = {
            **summary,
            "words_per_s": sum(x.seq_len for x in run.ok()) / run.wall if run.wall else 0.0,
            "words_sent": len(sent_words),
            "words_per_request": len(sent_words) / len(sent[name]) if sent[name] else 0.0,
            "distinct_share": len(set(sent_words)) / len(sent_words) if sent_words else float("nan"),
            "cache_hits": hits[name],
            "cache_misses": misses[name],
            "hit_rate": hits[name] / looked_up if looked_up else None,
            "read_to": readers[name].at,
            "slices": slices[name],
        }
    on, off = cells[f"cache on c{concurrency}"], cells[f"cache off c{concurrency}"]
    cells[f"cache on c{concurrency}"]["over_off"] = (
        on["words_per_s"] / off["words_per_s"] if off["words_per_s"] else float("nan")
    )
    cells[f"cache on c{concurrency}"]["over_off_slices"] = pairs
    return cells


async def _alternating(
    url: str, calls: tuple[Callable[[Any, int], Awaitable[Any]], ...], pairs: int
) -> tuple[list[list[float]], int]:
    """On one connection, one at a time, each of `calls` in turn, `pairs` + 20 rounds (the first 20 warm
    the connection, untimed): each call's times, and how many calls failed."""
    times: list[list[float]] = [[] for _ in calls]
    failed = 0
    async with grpc.aio.insecure_channel(url) as channel:
        stub = protocol.Stub(channel)
        for i in range(pairs + 20):
            for call, kept in zip(calls, times, strict=True):
                t0 = time.perf_counter()
                try:
                    await call(stub, i)
                except grpc.aio.AioRpcError:
                    failed += 1
                if i >= 20:
                    kept.append(time.perf_counter() - t0)
    return times, failed


def _kept_then_alternating(
    url: str, warm: list[Any] | tuple[Any, ...], calls: tuple[Callable[[Any, int], Awaitable[Any]], ...], pairs: int
) -> tuple[list[list[float]], int, tuple[int, int]]:
    """The `warm` requests sent once (their words kept by the cache), then `_alternating`: its times and
    failures, and the cache's hits and misses meanwhile."""
    with grpc.insecure_channel(url) as channel:
        for request in warm:
            with contextlib.suppress(grpc.RpcError):  # a refused text stays refused: counted as failed after
                protocol.Stub(channel).ModelInfer(request, timeout=60)
    h0, m0 = _cache_counts(url)
    times, failed = asyncio.run(_alternating(url, calls, pairs))
    h1, m1 = _cache_counts(url)
    return times, failed, (h1 - h0, m1 - m0)


def all_kept_round_trips(url: str, texts: list[str], pairs: int) -> dict[str, Any]:
    """On one connection, one at a time, a sentence whose every word the cache keeps, then ModelReady
    (the bare gRPC round trip): `pairs` times each, alternating. The misses counted meanwhile should be 0."""

    requests = [g2p_request([t], lexicon=False) for t in texts]
    ready = protocol.ModelReadyRequest(name="g2p")
    calls = (
        lambda stub, i: stub.ModelInfer(requests[i % len(requests)], timeout=30),
        lambda stub, i: stub.ModelReady(ready, timeout=30),
    )

    (kept, bare), failed, (hits, misses) = _kept_then_alternating(url, requests, calls, pairs)
    p50_kept, p50_bare = float(np.median(kept)) * 1e3, float(np.median(bare)) * 1e3
    return {
        "pairs": pairs,
        "texts": len(texts),
        "words_per_request": float(np.mean([len(words_of(t)) for t in texts])),
        "p50_ms": p50_kept,
        "p99_ms": float(np.percentile(kept, 99)) * 1e3,
        "bare_p50_ms": p50_bare,
        "over_bare_ms": p50_kept - p50_bare,
        "hits": hits,
        "misses": misses,
        "failed": failed,
    }


def _pct(x: float) -> str:
    return f"{x:.1%}"


def text_table(r: dict[str, Any]) -> str:
    """The corpus, its vetting, the per-cell table and the two targets, as markdown."""
    corpus, v = r["corpus"], r["vetting"]
    names = [Path(f).name for f in corpus["files"]]
    shown = ", ".join(names) if len(names) <= 6 else f"{', '.join(names[:3])}, ..., {names[-1]}"
    curve = " / ".join(_pct(x) for x in corpus["curve"].values())
    tops = " / ".join(k.split()[1] for k in corpus["curve"])
    sent = v["as_written"] + v["stripped"]
    reasons = "; ".join(f"{n} x {why}" for why, n in list(v["reasons"].items())[:3])
    load = " -> ".join(
        " ".join(f"{x:.2f}" for x in r[k]) for k in ("load_average_before", "load_average_after") if k in r
    )
    rows = [
        f"corpus: {len(names)} file(s) in {Path(corpus['files'][0]).parent} ({shown}): {corpus['quotes']:,} quotes, "
        f"{corpus['sentences']:,} sentences, {corpus['words']:,} words, {corpus['distinct_words']:,} distinct; "
        f"the top {tops} words cover {curve} of the tokens",
        f"sent: {sent:,} sentences, one a request ({v['as_written']:,} as written, {v['stripped']:,} without the words "
        f"the model cannot spell); refused even so, left out: {v['refused']:,}{f' ({reasons})' if reasons else ''}; "
        f"without words: {v['no_words']:,}",
        f"g2p, {r['seconds_per_cell']:g} s a server and concurrency in {r['slices']} alternating slices; "
        f"load average (1, 5, 15 min) {load}",
        "",
        "| server | c | words/s | on / off | request p50 / p99 ms | words a request | distinct share of words sent "
        "| cache hit rate | codes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in CONCURRENCY:
        for name in SERVERS:
            x = r[f"{name} c{c}"]
            ratio = f"{x['over_off']:.2f}" if "over_off" in x else "1"
            hit = _pct(x["hit_rate"]) if x["hit_rate"] is not None else "-"
            rows.append(
                f"| {name} | {c} | {x['words_per_s']:.0f} | {ratio} | {x['p50_ms']:.2f} / {x['p99_ms']:.2f} "
                f"| {x['words_per_request']:.1f} | {_pct(x['distinct_share'])} | {hit} | {x['codes']} |"
            )
    ratio = r["cache on c64"]["over_off"]
    low, high = min(r["cache on c64"]["over_off_slices"]), max(r["cache on c64"]["over_off_slices"])
    k = r["all_kept"]
    rows += [
        "",
        "| what | target | measured | |",
        "|---|---|---|---|",
        f"| real-text g2p c64 words/s: cache on / off, same run | >= 3x | {ratio:.2f}x (slices {low:.2f}-{high:.2f}) "
        f"| {'met' if ratio >= 3 else 'NOT met'} |",
        f"| request of all-kept words ({k['words_per_request']:.1f} words) p50 - bare round trip (ModelReady) p50 "
        f"| <= 0.3 ms | {k['over_bare_ms']:+.2f} ms ({k['p50_ms']:.2f} vs {k['bare_p50_ms']:.2f} ms; "
        f"misses {k['misses']}) "
        f"| {'met' if k['over_bare_ms'] <= 0.3 else 'NOT met'} |",
    ]
    return "\n".join(rows)


# 64 distinct words of ordinary English, all in the shipped lexicon: one request of them (qkv bench --lexicon).
LEXICON_WORDS = tuple(
    " ".join([
        "the of and to in is you that it he was for on are as with his they at be this have from or one had by",
        "word but not what all were we when your can said there use an each which she do how their if will up",
        "other about out many then them these so some her would make like him",
    ]).split()
)  # fmt: skip


def lexicon_vs_cached(url: str, words: list[str], pairs: int) -> dict[str, Any]:
    """On one connection, one at a time, a request of `words` answered from the lexicon, then the same
    words with `lexicon: false`, every one of them kept by the response cache (sent once before): what a
    request all of whose words the lexicon holds costs against one all of whose words were cached."""

    asks = (g2p_request([" ".join(words)]), g2p_request([" ".join(words)], lexicon=False))
    calls = (lambda stub, i: stub.ModelInfer(asks[0], timeout=30), lambda stub, i: stub.ModelInfer(asks[1], timeout=30))

    (lexicon, cached), failed, (hits, misses) = _kept_then_alternating(url, asks[1:], calls, pairs)
    p50_lexicon, p50_cached = float(np.median(lexicon)) * 1e3, float(np.median(cached)) * 1e3
    return {
        "pairs": pairs,
        "words_per_request": len(words),
        "lexicon_p50_ms": p50_lexicon,
        "lexicon_p99_ms": float(np.percentile(lexicon, 99)) * 1e3,
        "cached_p50_ms": p50_cached,
        "cached_p99_ms": float(np.percentile(cached, 99)) * 1e3,
        "ratio": p50_lexicon / p50_cached,
        "hits": hits,
        "misses": misses,
        "failed": failed,
    }


def lexicon_bench(models: Path, out: Path, pairs: int = 1000) -> dict[str, Any]:
    """`qkv bench --lexicon`: one g2p server (its newest version, response cache on), `lexicon_vs_cached`."""
    results: dict[str, Any] = {"model": "g2p", "load_average_before": os.getloadavg()}
    scratch = Path(tempfile.mkdtemp(prefix="qkv-lexicon-"))
    servers = Servers(models, scratch)
    try:
        on = servers.start(
            {"g2p": {"version_policy": {"latest": {"num_versions": 1}}, "response_cache": {"enable": True}}}
        )
        results["lexicon_vs_cached"] = lexicon_vs_cached(on.url, list(LEXICON_WORDS), pairs)
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    return _record(results, out, "lexicon", lexicon_table)


def lexicon_table(r: dict[str, Any]) -> str:
    x = r["lexicon_vs_cached"]
    load = " -> ".join(" ".join(f"{v:.2f}" for v in r[k]) for k in ("load_average_before", "load_average_after"))
    return "\n".join(
        [
            f"g2p, one connection, {x['pairs']} pairs of requests of {x['words_per_request']} words taken in turns; "
            f"load average (1, 5, 15 min) {load}",
            "",
            "| request of 64 words, c1 | p50 ms | p99 ms |",
            "|---|---|---|",
            f"| every word from the lexicon | {x['lexicon_p50_ms']:.2f} | {x['lexicon_p99_ms']:.2f} |",
            f"| every word from the response cache (`lexicon: false`) | {x['cached_p50_ms']:.2f} | "
            f"{x['cached_p99_ms']:.2f} |",
            "",
            "| what | target | measured | |",
            "|---|---|---|---|",
            f"| all-lexicon request p50 / all-cached request p50, same server | <= 1 | {x['ratio']:.2f} "
            f"({x['lexicon_p50_ms']:.2f} vs {x['cached_p50_ms']:.2f} ms; cache misses {x['misses']}) "
            f"| {'met' if x['ratio'] <= 1 else 'NOT met'} |",
        ]
    )
