"""`qkv bench --peers` end to end, on the one peer that needs no download: the plain grpc.aio server, run
with this environment's Python (the same pins as its own), beside qkv, for the quick path's cells.
Triton and MLServer need their environments made from PyPI, so they are not run here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT


def bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", "bench", *args], capture_output=True, text=True, timeout=300, cwd=ROOT
    )


def test_qkv_beside_the_plain_grpc_peer(tmp_path: Path) -> None:
    done = bench("--peers", "--quick", "--peer-set", "plain", "--peer-python", f"plain={sys.executable}",
                 "--out", str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    results = json.loads((tmp_path / "peers.json").read_text())
    assert results["model"].startswith("zoo_medium (encoder, 4 layers, d 256")
    assert list(results["cells"]) == ["seq 16 c32", "seq 64 c1"]
    for cell in results["cells"].values():
        assert set(cell) == {"ceiling", "qkv", "plain"}
        for server in ("qkv", "plain"):
            run = cell[server]
            # answered, or refused by qkv's queueing-time objective when the machine is loaded: never an error
            assert run["codes"].get("OK", 0) > 0 and set(run["codes"]) <= {"OK", "RESOURCE_EXHAUSTED"}, run
            assert run["rps"] > 0 and 0 < run["p50_ms"] <= run["p99_ms"]
    assert results["cells"]["seq 16 c32"]["ceiling"]["seq_per_s"] > 0
    assert results["cells"]["seq 16 c32"]["ceiling"]["batch"] in (1, 8, 32)
    assert results["cells"]["seq 64 c1"]["ceiling"]["p50_ms"] > 0
    # Both servers answer with the model's own output: the same as onnxruntime in process.
    assert set(results["parity"]) == {"qkv", "plain"} and max(results["parity"].values()) < 1e-3
    assert results["versions"]["plain"]["onnxruntime"] == results["versions"]["qkv"]["onnxruntime"]
    assert results["machine"]["cpus"] >= 1 and len(results["machine"]["load_average_before"]) == 3

    table = (tmp_path / "peers.md").read_text()
    assert done.stdout.startswith(table)
    header, rule, ceiling, *rows = table.splitlines()
    assert header == "| server | seq 16 c32: served / ceiling (req/s) | seq 64 c1: p50 ms | not OK |"
    assert rule == "|---|---|---|---|"
    assert re.fullmatch(
        r"\| ceiling, in process \| \d+ seq/s \(batch (1|8|32)\) \| [\d.]+ \(compute, \d+ threads?\) \| \|", ceiling
    )
    assert [r.split(" | ")[0] for r in rows] == ["| qkv", "| plain", "| qkv / best peer (above 1: qkv ahead)"]
    for row, server in zip(rows[:2], ("qkv", "plain"), strict=True):
        assert re.fullmatch(r"\| \w+ \| [\d.]+ \(\d+\) \| [\d.]+ \| \d+ \|", row), row
        # not OK: the refusals of both cells (qkv may refuse by its queueing objective on a busy machine)
        refused = sum(n for c in results["cells"].values() for code, n in c[server]["codes"].items() if code != "OK")
        assert row.endswith(f"| {refused} |"), (row, refused)
    assert re.fullmatch(r"\| qkv / best peer \(above 1: qkv ahead\) \| [\d.]+ \| [\d.]+ \| \|", rows[2])


def test_an_unknown_peer_is_named_before_anything_starts(tmp_path: Path) -> None:
    done = bench("--peers", "--peer-set", "plain,torchserve", "--out", str(tmp_path))
    assert done.returncode == 2
    assert "--peer-set plain,torchserve: no peer torchserve (choose from plain, triton, mlserver)" in done.stderr
    assert not (tmp_path / "peers.json").exists()
