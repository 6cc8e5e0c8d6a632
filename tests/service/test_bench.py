"""`qkv bench` end to end: the command against a real server on loopback, and one short suite section."""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.repository.layout import model_cards
from service.tools.bench import targets_table
from tests.conftest import ROOT, RunningServer, start_server, stop_server


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    """`qkv bench ARGS`; the timeout bounds only a hang (a loaded machine takes minutes over a short run)."""
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", *args], capture_output=True, text=True, timeout=900, cwd=ROOT
    )


@pytest.fixture(scope="module")
def bench_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A server of its own: the load below should not reach the shared one's other tests."""
    s = start_server([], tmp_path_factory.mktemp("bench-server") / "server.log")
    yield s
    stop_server(s)


def check_runs(done: subprocess.CompletedProcess[str], out: Path, names: list[str]) -> dict[str, Any]:
    """One run a concurrency, every request answered OK, in bench.json and in the printed lines."""
    assert done.returncode == 0, done.stderr
    report: dict[str, Any] = json.loads((out / "bench.json").read_text())
    assert list(report) == names
    for name, run in report.items():
        assert run["requests"] > 0 and run["codes"] == {"OK": run["requests"]}, run
        assert run["rps"] > 0 and run["wall_s"] > 0
        assert 0 < run["p50_ms"] <= run["p95_ms"] <= run["p99_ms"]
        assert run["client_cpu_share"] > 0 and math.isfinite(run["client_cpu_share"])
        for band in run["by_seq_len"].values():
            assert band["p50"] <= band["p95"] <= band["p99"]
        assert re.search(rf"^{name}: [\d.]+ req/s .* load generator CPU \d+%$", done.stdout, re.MULTILINE)
    for f in out.iterdir():  # whatever else a run writes is not empty either
        assert f.stat().st_size > 0, f
    return report


def test_bench_the_encoder_at_each_concurrency(bench_server: RunningServer, tmp_path: Path) -> None:
    args = ["--model", "g2p_encoder", "--lengths", "4:32", "--concurrency", "1,4", "--seconds", "1"]
    done = bench("--url", bench_server.url, *args, "--out", str(tmp_path))
    report = check_runs(done, tmp_path, ["concurrency 1", "concurrency 4"])
    for run in report.values():  # lengths 4..32: the first two bands of 32
        assert "4-31" in run["by_seq_len"] and set(run["by_seq_len"]) <= {"4-31", "32-63"}


def test_bench_g2p_words(bench_server: RunningServer, tmp_path: Path) -> None:
    done = bench(
        "--url", bench_server.url, "--model", "g2p", "--concurrency", "2", "--seconds", "1", "--out", str(tmp_path)
    )
    check_runs(done, tmp_path, ["concurrency 2"])


def test_suite_kv_section_and_its_targets_table(tmp_path: Path) -> None:
    """The suite's in-process section (no server): bench.json, targets.md from it, the same table printed."""
    pytest.importorskip("torch")
    done = bench("--suite", "--only", "kv", "--seconds", "1", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "bench.json").read_text())
    assert set(results) == {"machine", "seconds_per_run", "kv_cache"}
    table = (tmp_path / "targets.md").read_text()
    assert table == targets_table(results) and done.stdout.startswith(table)
    header, rule, *rows = table.splitlines()
    assert header == "| what | target | measured | |" and rule == "|---|---|---|---|"
    speedup = results["kv_cache"]["speedup"]
    assert rows == [
        "| g2p decode, 20 tokens, batch 32: with kv cache vs without (speed-up) | >= 2x "
        f"| {speedup:.2f}x | {'met' if speedup >= 2 else 'NOT met'} |"
    ]
    assert not (tmp_path / "bench.png").exists()  # the plot needs the ceiling and mixed sections
    assert f"wrote {tmp_path / 'bench.json'}, {tmp_path / 'targets.md'}" in done.stdout  # only what it wrote


def test_bench_against_no_server_says_so_and_fails(tmp_path: Path) -> None:
    """Nothing listens there: one clear line and exit 2, not a run of errors reported as a benchmark."""
    with socket.socket() as s:  # a port that was free a moment ago
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = bench("--url", f"127.0.0.1:{port}", "--seconds", "1", "--out", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr.startswith(f"qkv bench: cannot reach 127.0.0.1:{port}: UNAVAILABLE"), done.stderr
    assert not (tmp_path / "bench.json").exists()


def test_protocols_compares_http_and_grpc_on_one_server(tmp_path: Path) -> None:
    done = bench("--protocols", "--seconds", "0.4", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "protocols.json").read_text())
    for name in ("grpc", "http binary", "http json"):
        for c in (1, report["concurrency"]):
            run = report[f"{name} c{c}"]
            assert run["requests"] > 0 and run["codes"] == {"OK": run["requests"]}, (name, run)
        assert re.search(rf"^\| {name} \| [\d.]+ \|", done.stdout, re.MULTILINE), done.stdout


def test_versions_sets_g2p_version_2_beside_version_1_in_one_run(tmp_path: Path) -> None:
    done = bench("--versions", "--seconds", "0.3", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "versions.json").read_text())
    assert report["versions"] == ["1", "2"]
    for v in ("1", "2"):
        for c in (1, 64):
            run = report[f"v{v} c{c}"]
            assert run["words_per_s"] > 0 and run["p99_ms"] >= run["p50_ms"] > 0, (v, c)
            assert list(run["codes"]) == ["OK"] and len(run["rounds"]) == report["rounds"], (v, c, run["codes"])
    assert report["v1 c64"]["over_v1"] == 1.0
    # The table names each version's size and test figures from its own model card.
    for v, card in model_cards(ROOT / "models" / "g2p").items():
        wer, per = card["test"]["wer_stress_free"], card["test"]["per_stress_free"]
        row = f"| {v} | {card['parameters'] / 1e6:.2f} M | {wer:.2%} / {per:.2%} |"
        assert row in done.stdout, (row, done.stdout)
    assert (tmp_path / "versions.md").read_text().strip() in done.stdout
