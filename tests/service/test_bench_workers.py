"""`qkv bench --workers`: one process, two and auto workers side by side; a short run (slow suite) checks that
every cell was answered on each and that the table and the memory rows come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from service.tools.bench.workers_bench import WORKERS
from tests.service.test_bench import bench


@pytest.mark.slow
def test_workers_bench_runs_each_cell_on_one_two_and_auto_workers(tmp_path: Path) -> None:
    done = bench("--workers", "--seconds", "0.2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "workers.json").read_text())
    cells = [v for v in report.values() if isinstance(v, dict) and "model" in v]
    assert [(c["model"], c["length"]) for c in cells] == [
        ("zoo_small", 16), ("zoo_small", 64), ("zoo_medium", 16), ("zoo_medium", 64), ("g2p", 0)
    ]  # fmt: skip
    for cell in cells:
        for w in WORKERS:
            for c in (1, 32):
                run = cell[f"{w} c{c}"]
                assert run["requests"] > 0 and run["codes"] == {"OK": run["requests"]}, (cell["model"], w, c)
    assert len(report["memory"]["2"]) == 2 and len(report["memory"]["1"]) == 1
    assert "| zoo_small | 16 |" in done.stdout and "| 2 | 1 |" in done.stdout
