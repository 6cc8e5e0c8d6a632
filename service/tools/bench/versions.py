"""`qkv bench --versions`: g2p's served versions side by side on one server, in one run.

One test word a request, each request naming its version (`model_version`), at concurrency 1 (what a
version costs one caller) and 64 (what the server gets through). The versions alternate within
each round and each concurrency, so a drift of the machine's speed falls on all of them alike; the
ratio of each version's words/s to version 1's is the median of the rounds' ratios.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from service.repository.layout import available_versions
from service.tools import loadgen
from service.tools.bench.load import held_out_words, run_closed, word_maker
from service.tools.bench.sections import THROUGHPUT_QUEUE_WAIT_MS
from service.tools.bench.servers import Servers

__all__ = ["versions", "versions_table"]

CONCURRENCY = (1, 64)
ROUNDS = 3


def versions(models: Path, out: Path, seconds: float = 4.0) -> dict[str, Any]:
    """Words/s, p50 and p99 of every g2p version at c1 and c64 (throughput measured, not admission:
    the queue-wait objective is loosened, as in the suite's g2p section)."""
    scratch = Path(tempfile.mkdtemp(prefix="qkv-versions-"))
    servers = Servers(models, scratch)
    names = [str(v) for v in available_versions(models / "g2p")]
    words = held_out_words()
    rounds: dict[str, dict[int, list[dict[str, Any]]]] = {v: {c: [] for c in CONCURRENCY} for v in names}
    try:
        s = servers.start({"g2p": {"batching": {"max_queue_wait_ms": THROUGHPUT_QUEUE_WAIT_MS}}})
        for v in names:
            run_closed(s.url, word_maker(words, version=v), 8, 1.0, f"warm-up v{v}")
        for r in range(ROUNDS):
            for c in CONCURRENCY:
                for v in names:
                    run = run_closed(s.url, word_maker(words, version=v), c, seconds, f"v{v} c{c} {r + 1}/{ROUNDS}")
                    rounds[v][c].append(loadgen.summarise(run))
    finally:
        servers.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results: dict[str, Any] = {"model": "g2p", "versions": names, "seconds_per_run": seconds, "rounds": ROUNDS}
    first = names[0]
    for v in names:
        for c in CONCURRENCY:
            runs = rounds[v][c]
            ratios = [x["rps"] / y["rps"] for x, y in zip(runs, rounds[first][c], strict=True) if y["rps"]]
            results[f"v{v} c{c}"] = {
                "words_per_s": float(np.median([x["rps"] for x in runs])),
                "p50_ms": float(np.median([x["p50_ms"] for x in runs])),
                "p99_ms": float(np.median([x["p99_ms"] for x in runs])),
                "codes": {k: sum(x["codes"].get(k, 0) for x in runs) for k in {k for x in runs for k in x["codes"]}},
                f"over_v{first}": float(np.median(ratios)) if ratios else float("nan"),
                "rounds": runs,
            }
    out.mkdir(parents=True, exist_ok=True)
    (out / "versions.json").write_text(json.dumps(results, indent=2, default=float))
    return results


def versions_table(r: dict[str, Any], cards: dict[str, dict[str, Any]] | None = None) -> str:
    """The speed table, with each version's test figures from its model card where `cards` has them."""
    first = r["versions"][0]
    rows = [
        f"g2p, one test word a request, {r['seconds_per_run']:g} s a run, median of {r['rounds']} rounds",
        "",
        "| version | parameters | test WER / PER, stress-free | c1 words/s | c1 p50 / p99 ms "
        f"| c64 words/s | c64 / v{first} | c64 p50 / p99 ms | codes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for v in r["versions"]:
        one, many = r[f"v{v} c1"], r[f"v{v} c64"]
        card = (cards or {}).get(v, {})
        test = card.get("test", {})
        accuracy = f"{test['wer_stress_free']:.2%} / {test['per_stress_free']:.2%}" if test else "-"
        params = f"{card['parameters'] / 1e6:.2f} M" if "parameters" in card else "-"
        codes = {k: one["codes"].get(k, 0) + many["codes"].get(k, 0) for k in {*one["codes"], *many["codes"]}}
        rows.append(
            f"| {v} | {params} | {accuracy} | {one['words_per_s']:.0f} | {one['p50_ms']:.2f} / {one['p99_ms']:.2f} "
            f"| {many['words_per_s']:.0f} | {many[f'over_v{first}']:.2f} | {many['p50_ms']:.1f} / {many['p99_ms']:.1f} "
            f"| {codes} |"
        )
    return "\n".join(rows)
