"""`qkv bench --text` end to end on a small text of its own (no apt package): two real servers, the
response cache on and off, every sentence either sent or counted, the server's cache lookups matching
the words sent."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from service.tools.bench.text import CONCURRENCY, SERVERS, frequency_curve, read_sentences, words_of
from tests.service.test_bench import bench

LONG = " ".join(["one"] * 70) + "."  # more words than g2p's max_words (64): refused however stripped

# Written like the fortunes files: quotes between % lines, one in nroff's overstrike underline.
SAMPLE = f"""The quick brown fox jumps over the lazy dog.  The dog sleeps!
%
A café opened in 1988?  Naive people drink tea there.
%
----
%
1984.
%
{LONG}
%
An _\x08u_\x08n_\x08d_\x08e_\x08r_\x08lined word.
%
The fox and the dog
are friends.  The tea is hot, said the fox.
"""


@pytest.fixture
def sample(tmp_path: Path) -> Path:
    path = tmp_path / "sample"
    path.write_text(SAMPLE)
    return path


def test_the_sample_reads_as_quotes_of_sentences(sample: Path) -> None:
    assert read_sentences([sample]) == [
        ["The quick brown fox jumps over the lazy dog.", "The dog sleeps!"],
        ["A café opened in 1988?", "Naive people drink tea there."],
        ["----"],
        ["1984."],
        [LONG],
        ["An underlined word."],
        ["The fox and the dog are friends.", "The tea is hot, said the fox."],
    ]
    # the words as the model reads them (its text rules: accents folded, numbers spelled out)
    assert words_of("A café opened in 1988?") == ["a", "cafe", "opened", "in", "nineteen", "eighty", "eight"]
    assert frequency_curve(["a", "a", "a", "b", "c"], (1, 2, 3)) == {"top 1": 0.6, "top 2": 0.8, "top 3": 1.0}


def test_text_bench_sends_each_sentence_or_counts_it(sample: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    done = bench("--text-file", str(sample), "--seconds", "0.4", "--out", str(out))
    assert done.returncode == 0, done.stderr
    r = json.loads((out / "text.json").read_text())
    corpus = r["corpus"]
    assert corpus["files"] == [str(sample)]
    assert (corpus["quotes"], corpus["sentences"], corpus["words"], corpus["distinct_words"]) == (7, 10, 114, 32)
    assert corpus["curve"]["top 10"] == pytest.approx(92 / 114) and corpus["curve"]["top 1000"] == 1.0
    # café and the years are read as written (accents folded, numbers spelled out); 70 words refused;
    # "----" no words at all
    v = r["vetting"]
    assert (v["as_written"], v["stripped"], v["refused"], v["no_words"]) == (8, 0, 1, 1)
    assert v["reasons"] == {"INVALID_ARGUMENT: input ...: ... words in one request, the limit is ...": 1}
    for c in CONCURRENCY:
        on, off = r[f"cache on c{c}"], r[f"cache off c{c}"]
        for cell in (on, off):
            assert cell["requests"] > 0 and cell["codes"] == {"OK": cell["requests"]}, cell
            assert cell["words_per_s"] > 0 and 0 < cell["p50_ms"] <= cell["p99_ms"]
            assert 0 < cell["distinct_share"] <= 1
        # the cache server looked up every word it was sent, once; the other none
        assert on["cache_hits"] + on["cache_misses"] == on["words_sent"] and on["cache_hits"] > 0
        assert (off["cache_hits"], off["cache_misses"], off["hit_rate"]) == (0, 0, None)
        assert on["over_off"] == pytest.approx(on["words_per_s"] / off["words_per_s"])
        assert len(on["over_off_slices"]) == r["slices"]
    kept = r["all_kept"]
    assert kept["misses"] == 0 and kept["failed"] == 0 and kept["hits"] > kept["pairs"]
    assert kept["bare_p50_ms"] > 0 and 0 < kept["p50_ms"] <= kept["p99_ms"]
    # The printed table: the corpus, what was sent, a row a server and concurrency, the two targets.
    table = (out / "text.md").read_text().strip()
    assert table in done.stdout
    assert "10 sentences, 114 words, 32 distinct" in table
    assert "sent: 8 sentences, one a request (8 as written, 0 without the words" in table
    assert "refused even so, left out: 1" in table and "without words: 1" in table
    assert (
        "| server | c | words/s | on / off | request p50 / p99 ms | words a request | distinct share of words sent "
        "| cache hit rate | codes |"
    ) in table
    for c in CONCURRENCY:
        for name in SERVERS:
            hit = r"[\d.]+%" if name == "cache on" else "-"
            row = rf"^\| {name} \| {c} \| \d+ \| [\d.]+ \| [\d.]+ / [\d.]+ \| [\d.]+ \| [\d.]+% \| {hit} \| "
            row += r"\{'OK': \d+\} \|$"
            assert re.search(row, table, re.MULTILINE), (row, table)
    ratio = r"^\| real-text g2p c64 words/s: cache on / off, same run \| >= 3x "
    ratio += r"\| [\d.]+x \(slices [\d.]+-[\d.]+\) \| (met|NOT met) \|$"
    floor = r"^\| request of all-kept words .* \| <= 0.3 ms \| [+-][\d.]+ ms .*misses 0\) \| (met|NOT met) \|$"
    assert re.search(ratio, table, re.MULTILINE) and re.search(floor, table, re.MULTILINE), table


def test_text_file_not_there_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    done = bench("--text-file", str(tmp_path / "nothing"), "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.strip() == f"qkv bench: --text-file not found: {tmp_path / 'nothing'}"
