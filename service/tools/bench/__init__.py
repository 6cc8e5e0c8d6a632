"""`qkv bench`: load tests over the v2 protocol.

    qkv bench --url 127.0.0.1:8001 --model g2p_encoder --lengths 4:256 --concurrency 1,8,32
    qkv bench --model my_model                # any served model: requests made from its metadata
    qkv bench --suite --out runs/bench        # every BENCHMARKS.md target, servers started here
    qkv bench --protocols --seconds 4         # HTTP/REST against gRPC on one server
    qkv bench --peers                         # beside Triton, MLServer, plain grpc.aio (makes their venvs)
    qkv bench --text                          # g2p on English text, its response cache on and off
    qkv bench --lexicon                       # g2p: 64 words from the lexicon against the same 64 cached
    qkv bench --sequences                     # a stateful model: 64 sequences at once vs one at a time
    qkv bench --text-model DIR                # a Hugging Face text folder served, against its ceiling
    qkv bench --generation-model DIR          # an exported generator: qkv's engine against optimum's generate

Against a running server (--url, default $QKV_URL or 127.0.0.1:8001, and --model): any model it serves,
each request one row made from the model's metadata, of a length from --lengths or, without it, from 1
to the model's longest sequence. It writes bench.json: requests/s and latency percentiles by concurrency
(or --rate), and by sequence length. No plot and no ceiling: those need the servers the other modes
start themselves.

--suite and the other modes start their own servers on loopback. Every served figure of theirs is a ratio
to a figure measured in the same run on the same machine (the in-process onnxruntime ceiling, or the
same server with one setting changed), so the numbers transfer between machines better than absolute
ones. Results: JSON, PNG plots (matplotlib), a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import grpc

from service import protocol
from service.config import DEFAULT_URL, server_url
from service.errors import UsageError, in_range, readable_file
from service.seq2seq.graphs import session_options
from service.tools import loadgen
from service.tools.bench.any_model import model_maker, model_shape
from service.tools.bench.ceilings import in_process_latency, raw_ceiling
from service.tools.bench.load import by_length, run_closed, run_open
from service.tools.bench.report import targets_table
from service.tools.bench.runs import SECTIONS, perf_analyzer_crosscheck, soak, suite
from service.tools.bench.servers import padding_share, scrape, variant

# The parts: ceilings (in process, no server: every ratio's denominator), servers (repository
# variants taking turns), load (what is sent), sections (the suite's, one function each), runs
# (suite, soak, perf_analyzer), report (plot and targets table). Below: the command line.

__all__ = [
    "in_process_latency",
    "main",
    "padding_share",
    "perf_analyzer_crosscheck",
    "raw_ceiling",
    "scrape",
    "session_options",
    "soak",
    "suite",
    "targets_table",
    "variant",
]


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="qkv bench", description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--suite", action="store_true", help="run every BENCHMARKS.md target (starts its own servers)")
    parser.add_argument("--perf-analyzer", type=Path, metavar="BIN", help="cross-check with Triton's perf_analyzer")
    parser.add_argument("--soak", type=int, default=0, metavar="N", help="N mixed requests: memory and fd growth")
    parser.add_argument("--zoo", action="store_true", help="models qkv did not train: tuned vs fixed batching")
    parser.add_argument("--workers", action="store_true", help="1, 2 and auto worker processes: zoo encoders, g2p")
    parser.add_argument("--protocols", action="store_true", help="HTTP/REST against gRPC: c1 latency, throughput")
    parser.add_argument("--versions", action="store_true", help="g2p's versions side by side: words/s, p50/p99")
    parser.add_argument("--peers", action="store_true", help="zoo_medium on qkv, Triton, MLServer, plain grpc.aio")
    parser.add_argument("--peer-set", default="plain,triton,mlserver", help="--peers: which peers beside qkv")
    parser.add_argument("--peer-python", action="append", default=[], metavar="PEER=PYTHON",
                        help="--peers: run PEER with this interpreter, not an environment made for it")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="--peers: seq 16 only, 1 s a cell: a smoke test")
    parser.add_argument("--text", action="store_true", help="g2p on English text (fortunes): response cache on/off")
    parser.add_argument(
        "--lexicon", action="store_true", help="g2p: a request of 64 lexicon words against the same words all cached"
    )
    parser.add_argument("--text-file", type=Path, metavar="PATH", help="--text on this file (or directory) instead")
    parser.add_argument("--sequences", action="store_true", help="stateful steps: 64 sequences at once vs one")
    parser.add_argument("--text-model", type=Path, metavar="DIR", help="a text model's exported folder, served")
    parser.add_argument("--text-source", type=Path, metavar="DIR", help="--text-model: sentence-transformers' folder")
    parser.add_argument(
        "--text-c1", action="store_true", help="--text-model: concurrency 1 alone, with the server's stages"
    )
    parser.add_argument(
        "--text-words", type=int, metavar="N", help="--text-model: each text cut to its first N words (short texts)"
    )
    parser.add_argument(
        "--generation-model", type=Path, metavar="DIR", help="an exported generation folder: engine vs optimum"
    )
    parser.add_argument("--model-repository", type=Path, help="default: models (a --url run needs none)")
    parser.add_argument("--url", default=server_url(), help=f"server HOST:PORT (default: $QKV_URL, else {DEFAULT_URL})")
    parser.add_argument("--model", default="g2p_encoder", help="any model the server at --url serves")
    parser.add_argument("--lengths", help="N, or LO:HI uniform (default: 1 to the model's longest sequence)")
    parser.add_argument("--concurrency", default="1,8,32", help="closed loop: comma-separated")
    parser.add_argument("--rate", type=float, default=0.0, help="open loop at this many requests/s instead")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--out", type=Path, default=Path("runs/bench"))
    parser.add_argument("--only", default=",".join(SECTIONS), help=f"suite sections: {','.join(SECTIONS)}")
    args = parser.parse_args(argv)
    _check(args)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.perf_analyzer:
        r = perf_analyzer_crosscheck(args.perf_analyzer, args.model_repository, args.out, args.seconds)
        print(json.dumps(r))
        return 0
    if args.soak:
        r = soak(args.model_repository, args.out, args.soak)
        print(
            f"soak: {r['requests']} requests {r['codes']}; RSS {r['rss_before_mb']:.0f} -> {r['rss_after_mb']:.0f} MB "
            f"({r['rss_growth']:+.1%}); fds {r['fds_before']} -> {r['fds_after']}"
        )
        return 0
    if args.zoo:
        from service.tools.bench.zoo_bench import zoo_benchmark, zoo_table

        print(zoo_table(zoo_benchmark(args.out, args.seconds)))
        print(f"wrote {args.out / 'zoo.json'}, {args.out / 'zoo.md'}")
        return 0
    if args.workers:
        from service.tools.bench.workers_bench import workers_benchmark, workers_table

        print(workers_table(workers_benchmark(args.model_repository, args.out, args.seconds)))
        print(f"wrote {args.out / 'workers.json'}, {args.out / 'workers.md'}")
        return 0
    if args.peers:
        from service.tools.bench.peers import peers_benchmark, peers_table

        python = {k: Path(v).absolute() for k, _, v in (x.partition("=") for x in args.peer_python)}
        peer_set = tuple(args.peer_set.split(",")) if args.peer_set else ()
        lengths, seconds = ((16,), 1.0) if args.quick else ((16, 64, 256), args.seconds)
        print(peers_table(peers_benchmark(args.out, seconds, peer_set, lengths, python)))
        print(f"wrote {args.out / 'peers.json'}, {args.out / 'peers.md'}")
        return 0
    if args.protocols:
        from service.tools.bench.protocols import protocols, protocols_table

        print(protocols_table(protocols(args.model_repository, args.out, args.seconds)))
        print(f"wrote {args.out / 'protocols.json'}")
        return 0
    if args.lexicon:
        from service.tools.bench.text import lexicon_bench, lexicon_table

        print(lexicon_table(lexicon_bench(args.model_repository, args.out)))
        print(f"wrote {args.out / 'lexicon.json'}, {args.out / 'lexicon.md'}")
        return 0
    if args.text or args.text_file:
        from service.tools.bench.text import text_bench, text_table

        print(text_table(text_bench(args.model_repository, args.out, args.seconds, args.text_file)))
        print(f"wrote {args.out / 'text.json'}, {args.out / 'text.md'}")
        return 0
    if args.text_model and args.text_c1:
        from service.tools.bench.text_c1 import text_c1_bench, text_c1_table

        print(text_c1_table(text_c1_bench(args.text_model, args.out, args.seconds)))
        print(f"wrote {args.out / 'text_c1.json'}")
        return 0
    if args.text_model:
        from service.tools.bench.text_models import text_model_bench, text_model_table

        results = text_model_bench(args.text_model, args.out, args.seconds, args.text_source, args.text_words)
        print(text_model_table(results))
        print(f"wrote {args.out / 'text_model.json'}")
        return 0
    if args.generation_model:
        from service.tools.bench.generation import generation_bench, generation_table

        print(generation_table(generation_bench(args.generation_model, args.out)))
        print(f"wrote {args.out / 'generation.json'}")
        return 0
    if args.sequences:
        from service.tools.bench.sequences import sequences_bench, sequences_table

        print(sequences_table(sequences_bench(args.out, args.seconds)))
        print(f"wrote {args.out / 'sequences.json'}")
        return 0
    if args.versions:
        from service.repository.layout import model_cards
        from service.tools.bench.versions import versions, versions_table

        measured = versions(args.model_repository, args.out, args.seconds)
        table = versions_table(measured, model_cards(args.model_repository / "g2p"))
        (args.out / "versions.md").write_text(table + "\n")
        print(table)
        print(f"wrote {args.out / 'versions.json'}, {args.out / 'versions.md'}")
        return 0
    if args.suite:
        results = suite(args.model_repository, args.out, args.seconds, tuple(args.only.split(",")))
        print(targets_table(results))
        for name, section in results.items():
            if isinstance(section, dict) and "skipped" in section:
                print(f"{name}: skipped ({section['skipped']})")
        written = [args.out / f for f in ("bench.json", "bench.png", "targets.md") if (args.out / f).exists()]
        print(f"wrote {', '.join(map(str, written))}")
        return 0
    problem = _not_ready(args.url, args.model)
    if problem:
        print(f"qkv bench: {problem}", file=sys.stderr)
        return 2
    try:
        shape = model_shape(args.url, args.model)
    except grpc.RpcError as e:
        print(f"qkv bench: model '{args.model}' on {args.url}: {e.code().name}: {e.details()}", file=sys.stderr)
        return 2
    make = model_maker(shape, _lengths(args.lengths) if args.lengths else None)
    report: dict[str, Any] = {}
    if args.rate:
        report[f"rate {args.rate:g}"] = loadgen.summarise(
            run_open(args.url, make, args.rate, args.seconds, "open loop")
        )
    else:
        for c in _concurrency(args.concurrency):
            run = run_closed(args.url, make, c, args.seconds, f"concurrency {c}")
            report[f"concurrency {c}"] = {**loadgen.summarise(run), "by_seq_len": by_length(run)}
    for name, r in report.items():
        print(f"{name}: {r['rps']:.1f} req/s  p50 {r['p50_ms']:.2f} ms  p99 {r['p99_ms']:.2f} ms  codes {r['codes']}  "
              f"load generator CPU {r['client_cpu_share']:.0%}")  # fmt: skip
    (args.out / "bench.json").write_text(json.dumps(report, indent=2, default=float))
    if not any(r["codes"].get("OK") for r in report.values()):
        print(f"qkv bench: no request to {args.url} succeeded", file=sys.stderr)
        return 1
    return 0


def _check(args: argparse.Namespace) -> None:
    """A UsageError naming the first flag whose value cannot run, before any server starts or request goes."""
    if args.seconds <= 0:
        raise UsageError(f"--seconds {args.seconds:g}: must be above 0")
    in_range("--rate", args.rate, 0)
    in_range("--soak", args.soak, 0)
    if args.lengths:
        _lengths(args.lengths)
    _concurrency(args.concurrency)
    unknown = set(args.only.split(",")) - set(SECTIONS)
    if unknown:
        raise UsageError(
            f"--only {args.only}: no section {', '.join(sorted(unknown))} (choose from {', '.join(SECTIONS)})"
        )
    if args.out.exists() and not args.out.is_dir():
        raise UsageError(f"--out {args.out}: must be a directory, not a file")
    if args.perf_analyzer:
        readable_file(args.perf_analyzer, "perf_analyzer")
    if args.peers:
        _check_peers(args.peer_set, args.peer_python)
    if args.text or args.text_file:
        from service.tools.bench.text import corpus_files

        corpus_files(args.text_file)  # the corpus there, or how to get it
    given, args.model_repository = args.model_repository is not None, args.model_repository or Path("models")
    local = (
        args.suite or args.soak or args.perf_analyzer or args.protocols or args.versions or args.text or args.workers
    )
    if (local or args.text_file or given) and not args.model_repository.is_dir():  # others: their own, or --url
        raise UsageError(f"model repository not found: {args.model_repository}")


def _check_peers(peer_set: str, peer_python: list[str]) -> None:
    """--peer-set names known peers; each --peer-python is PEER=PYTHON with an interpreter that exists."""
    from service.tools.bench.peers import PEERS

    unknown = set(filter(None, peer_set.split(","))) - set(PEERS)
    if unknown:
        raise UsageError(
            f"--peer-set {peer_set}: no peer {', '.join(sorted(unknown))} (choose from {', '.join(PEERS)})"
        )
    for text in peer_python:
        name, eq, python = text.partition("=")
        if not eq or name not in PEERS:
            raise UsageError(f"--peer-python {text}: must be PEER=PYTHON, PEER one of {', '.join(PEERS)}")
        readable_file(Path(python), "--peer-python interpreter")


def _lengths(text: str) -> tuple[int, int]:
    """--lengths N or LO:HI, as the (LO, HI) of sequence lengths drawn uniformly."""
    lo, colon, hi = text.partition(":")
    try:
        low, high = int(lo), int(hi if colon else lo)
    except ValueError:
        raise UsageError(f"--lengths {text}: must be N or LO:HI, whole numbers") from None
    if not 1 <= low <= high:
        raise UsageError(f"--lengths {text}: must be 1 or more, and LO no more than HI")
    return low, high


def _concurrency(text: str) -> list[int]:
    """--concurrency 1,8,32 as the closed loop's numbers of clients, each 1 or more."""
    try:
        levels = [int(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--concurrency {text}: must be whole numbers separated by commas") from None
    if min(levels) < 1:
        raise UsageError(f"--concurrency {text}: must be 1 or more clients each")
    return levels


def _not_ready(url: str, model: str) -> str | None:
    """Why a load test against `url` would measure nothing but errors, or None when `model` is ready."""
    with grpc.insecure_channel(url) as channel:
        try:
            ready = protocol.Stub(channel).ModelReady(protocol.ModelReadyRequest(name=model), timeout=5).ready
        except grpc.RpcError as e:
            return f"cannot reach {url}: {e.code().name}: {e.details()}"
    return None if ready else f"model '{model}' is not ready on {url}"
