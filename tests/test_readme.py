"""The README, followed as written: every example that calls a server runs against a real one, and
prints what the README says it prints. (`make serve` and `make test` themselves are what CI runs.)"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT, RunningServer, start_server

README = (ROOT / "README.md").read_text(encoding="utf-8")
DEFAULT_URL = "127.0.0.1:8001"
DEFAULT_HTTP = "127.0.0.1:8000"


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


def shell(command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


def test_python_examples_print_what_the_readme_says(server: RunningServer) -> None:
    """The tritonclient example, its streaming sequel (same namespace), and the shipped client: each
    prints what the comment beside its print says."""
    namespace: dict[str, object] = {}
    for code in blocks("python"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(code.replace(DEFAULT_URL, server.url), namespace)  # the README's own code
        printed = out.getvalue().splitlines()
        expected = [m.group(1) for m in re.finditer(r"print\(.*\)\s+# (.+)", code)]
        assert (expected or "start_stream" in code) and printed[: len(expected)] == expected, (code, printed)
        if "start_stream" in code:  # each word's answer, no error
            assert sorted(printed) == ["[b'AH0 T EH1 N SH AH0 N']", "[b'T R AE0 N S F AO1 R M ER0']"], printed


def test_command_line_examples_work_against_a_server(server: RunningServer, tmp_path: Path) -> None:
    commands = [
        line.split("#")[0].strip()
        for block in blocks("bash")
        for line in block.splitlines()
        if line.startswith(".venv/bin/qkv ") and not line.startswith(".venv/bin/qkv serve ")  # a client each
    ]
    assert len(commands) >= 5, commands
    for command in commands:
        for one in command.split(" && "):
            argv = one.replace(".venv/bin/qkv", f"{sys.executable} -m service.cli") + f" --url {server.url}"
            done = shell(argv, tmp_path)
            assert done.returncode == 0, (one, done.stderr)
            if one.endswith("qkv infer --model g2p hello world"):
                assert done.stdout.splitlines() == ["hello\tHH AH0 L OW1", "world\tW ER1 L D"]
            if "--out attention.png" in one:
                assert (tmp_path / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_grpcurl_example_decodes_to_the_phonemes(server: RunningServer) -> None:
    """Run from the repository root, as written: `make serve` installed `.venv/bin/grpcurl` there."""
    [block] = [b for b in blocks("bash") if "grpcurl" in b]
    lines = block.replace(DEFAULT_URL, server.url).splitlines()
    assert all(line.startswith(".venv/bin/grpcurl ") for line in lines if "grpcurl -" in line), lines
    listing = shell(lines[0], ROOT)
    assert listing.returncode == 0 and "inference.GRPCInferenceService" in listing.stdout, listing.stderr
    pipeline = "\n".join(line for line in lines[1:] if not line.startswith("# "))
    done = shell(pipeline, ROOT)
    expected = next(line[2:] for line in lines if line.startswith("# "))
    assert done.returncode == 0 and done.stdout == expected, (done.stdout, done.stderr)


def test_curl_examples_print_what_the_readme_says(server: RunningServer, tmp_path: Path) -> None:
    [block] = [b for b in blocks("bash") if "generate_stream" in b]
    commands = block.replace(DEFAULT_HTTP, server.http_url).replace("\\\n", "").splitlines()
    run = [(c, commands[i + 1][2:] if i + 1 < len(commands) and commands[i + 1].startswith("# ") else None)
           for i, c in enumerate(commands) if c.startswith("curl")]  # fmt: skip
    assert len(run) == 3, run
    for command, expected in run:
        done = shell(command, tmp_path)
        assert done.returncode == 0, (command, done.stderr)
        if expected is not None:
            assert done.stdout.strip() == expected, (command, done.stdout)
        else:  # the stream: one event a word, then the whole
            events = [e for e in done.stdout.split("\n\n") if e.startswith("data: ")]
            assert len(events) == 3 and '"final": true' in events[-1], done.stdout


def test_load_and_unload_as_the_readme_says(tmp_path: Path) -> None:
    """The README's serve line (explicit mode on loopback) and its two curl calls, in order: the load
    makes g2p ready, the unload takes it away. The same server listening beyond loopback refuses the load,
    which is why the README names both conditions."""
    [block] = [b for b in blocks("bash") if "/repository/models/" in b]
    lines = [line.split("#")[0].strip() for line in block.splitlines()]
    serve, calls = lines[0], [line for line in lines if line.startswith("curl ")]
    assert serve.startswith(".venv/bin/qkv serve ") and len(calls) == 2, lines
    args = serve.split()[2:]
    assert args[args.index("--model-control-mode") + 1] == "explicit" and "--host" in args, args
    with start_server(args, tmp_path / "loopback.log") as s:
        ready = f"{s.http_url}/v2/models/g2p/ready"
        status = f"curl -s -o /dev/null -w '%{{http_code}}' {ready}"
        assert shell(status, tmp_path).stdout != "200"  # explicit mode loads nothing by itself
        for call, ready_after in zip(calls, (True, False), strict=True):
            done = shell(call.replace(DEFAULT_HTTP, s.http_url), tmp_path)
            assert done.returncode == 0, (call, done.stdout, done.stderr)
            assert (shell(status, tmp_path).stdout == "200") is ready_after, call
    beyond = [*args[: args.index("--host")], *args[args.index("--host") + 2 :], "--host", "0.0.0.0"]
    with start_server(beyond, tmp_path / "beyond.log") as s:
        refused = shell(calls[0].replace(DEFAULT_HTTP, s.http_url).replace("-sf", "-s"), tmp_path)
        assert "loopback" in refused.stdout or "admin" in refused.stdout, refused.stdout


def test_compose_commands_for_both_composes_and_offline() -> None:
    """Both compose front ends are named, and the offline start is one line of services the compose file
    has; tests/deploy/test_deploy_stack.py starts its stack with that very line."""
    lines = [line.split("#")[0].strip() for block in blocks("bash") for line in block.splitlines()]
    assert "docker compose up -d --build" in lines and "docker-compose up -d --build" in lines, lines
    [offline] = [line for line in lines if line.startswith("deploy/docker/offline-bases.sh && ")]
    services = offline.split("--build", 1)[1].split()
    compose = (ROOT / "docker-compose.yml").read_text()
    assert services == ["qkv", "prometheus"] and all(f"\n  {name}:\n" in compose for name in services), offline
