"""Dockerfiles, .dockerignore and build.sh, checked without a Docker engine.

The Dockerfiles are parsed and held to the rules that matter (hadolint is not available), and
build.sh (buildx, which the Debian engine lacks) runs against a stand-in `docker` that records
its call. test_deploy_stack.py builds and runs the CPU image for real.
"""

from __future__ import annotations

import os
import re
import shutil
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from deploy_helpers import DOCKER, ROOT, ok, run, tool

DOCKERFILES = {"cpu": DOCKER / "Dockerfile", "cuda": DOCKER / "Dockerfile.cuda"}
FINAL_STAGE_FORBIDDEN = re.compile(
    r"\b(torch|build-essential|gcc|g\+\+|clang|make|cmake|python3?-dev|python3?\.\d+-dev|\.\[export\])\b"
)


@dataclass
class Stage:
    image: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]


def parse(path: Path) -> list[Stage]:
    """Stages of a Dockerfile: continuation lines joined, comments dropped."""
    logical: list[str] = []
    buf = ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("#") or (not line and not buf):
            continue
        if line.endswith("\\"):
            buf += line[:-1].strip() + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    stages: list[Stage] = []
    for line in logical:
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        if keyword == "FROM":
            m = re.fullmatch(r"(?:--platform=\S+\s+)?(\S+)(?:\s+AS\s+(\S+))?", args.strip(), re.IGNORECASE)
            assert m, f"{path}: cannot read FROM {args}"
            stages.append(Stage(m.group(1), m.group(2)))
        elif stages:
            stages[-1].instructions.append((keyword, args.strip()))
        else:
            assert keyword == "ARG", f"{path}: {keyword} before the first FROM"
    return stages


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in stage.all("ENV"):
        for key, value in re.findall(r'(\w+)=("[^"]*"|\S+)', args):
            env[key] = value.strip('"')
    return env


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_base_images_are_pinned_by_tag(flavour: str) -> None:
    stages = parse(DOCKERFILES[flavour])
    for stage in stages:
        if stage.image in {s.name for s in stages if s.name}:
            continue
        repo, sep, tag = stage.image.rpartition(":")
        assert sep and "/" not in tag and "$" not in stage.image, f"{stage.image}: pin the base image by tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{stage.image}: pin a versioned tag"
        assert repo


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_multi_stage_with_a_slim_final_stage(flavour: str) -> None:
    stages = parse(DOCKERFILES[flavour])
    assert len(stages) >= 2
    builder, final = stages[0], stages[-1]
    assert builder.name and final.name
    copies = final.all("COPY")
    assert any(c.startswith(f"--from={builder.name} ") for c in copies), copies
    for keyword, args in final.instructions:
        assert not FINAL_STAGE_FORBIDDEN.search(args), f"final stage: {keyword} {args}"
        if keyword == "RUN":
            assert "pip install" not in args, f"final stage installs packages with pip: {args}"
            if "apt-get install" in args:
                assert "--no-install-recommends" in args, args
    assert "torch" not in DOCKERFILES[flavour].read_text(encoding="utf-8").replace("no torch", "")


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_builder_installs_the_lock_then_the_serving_package(flavour: str) -> None:
    """The lock (hash-checked) first, in a layer of its own, then the project's wheel without dependencies."""
    builder = parse(DOCKERFILES[flavour])[0]
    runs = " ".join(builder.all("RUN"))
    assert re.search(r"pip wheel --no-deps --wheel-dir /wheels \.", runs), runs
    lock = {"cpu": "requirements/serve.txt", "cuda": "requirements/cuda.txt"}[flavour]
    assert f"{lock} /opt/qkv/requirements.lock" in builder.all("COPY")
    locked = runs.index("/opt/qkv/venv/bin/pip install --no-compile --require-hashes -r /opt/qkv/requirements.lock")
    assert locked < runs.index("/opt/qkv/venv/bin/pip install --no-compile --no-deps /wheels/*.whl")
    copies = [args for kw, args in builder.instructions if kw == "COPY"]
    assert copies.index(f"{lock} /opt/qkv/requirements.lock") < copies.index("service/ service/"), (
        "the lock's layer comes before the sources, so a source change does not reinstall the dependencies"
    )
    copied = {word for args in builder.all("COPY") for word in args.split()}
    assert {"pyproject.toml", "service/", "export/"} <= copied, copied


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_final_stage_runs_qkv_as_non_root_with_health_check(flavour: str) -> None:
    final = parse(DOCKERFILES[flavour])[-1]
    users = final.all("USER")
    assert users, "final stage has no USER"
    user = users[-1].split(":")[0]
    assert user not in {"root", "0"}, users
    health = final.all("HEALTHCHECK")
    assert len(health) == 1 and re.search(r"\bCMD\b.*\bqkv health\b", health[0]), health
    exposed = {p for args in final.all("EXPOSE") for p in args.split()}
    assert {"8000", "8001", "8002"} <= exposed
    assert final.all("ENTRYPOINT") == ['["qkv"]'] and final.all("CMD") == ['["serve"]']
    # The user exists: created in the final stage with the same uid.
    assert any(f"--uid {user}" in r for r in final.all("RUN")), "USER's uid is not created in the final stage"


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_models_are_baked_in_and_found_by_default(flavour: str) -> None:
    final = parse(DOCKERFILES[flavour])[-1]
    assert "models/ /opt/qkv/models/" in final.all("COPY")
    env = env_of(final)
    assert env["QKV_MODEL_REPOSITORY"] == "/opt/qkv/models"
    assert env["QKV_GRPC_PORT"] == "8001" and env["QKV_METRICS_PORT"] == "8002" and env["QKV_HTTP_PORT"] == "8000"
    assert env["QKV_DEVICE"] == {"cpu": "cpu", "cuda": "cuda"}[flavour]
    assert env["PATH"].startswith("/opt/qkv/venv/bin:")


def test_cuda_image_installs_a_pinned_onnxruntime_gpu_and_checks_its_provider() -> None:
    """onnxruntime-gpu comes from requirements/cuda.txt (tests/test_lock.py: pinned, no CPU onnxruntime)."""
    stages = parse(DOCKERFILES["cuda"])
    assert all(s.image.startswith("nvidia/cuda:") and "cudnn-runtime" in s.image for s in stages), stages
    runs = " ".join(stages[0].all("RUN"))
    install = runs.index("pip install --no-compile --require-hashes -r /opt/qkv/requirements.lock")
    assert install < runs.index("'CUDAExecutionProvider' in o.get_available_providers()")
    lock = (ROOT / "requirements" / "cuda.txt").read_text(encoding="utf-8")
    assert re.search(r"^onnxruntime-gpu==\d+\.\d+\.\d+ ", lock, re.MULTILINE)
    assert not re.search(r"^onnxruntime==", lock, re.MULTILINE)


# --- .dockerignore ---------------------------------------------------------------------


def _pattern(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i : j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def ignored(path: str, rules: list[str]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    verdict = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = _pattern(rule.lstrip("!").strip("/"))
        if any(pattern.fullmatch(c) for c in candidates):
            verdict = not negate
    return verdict


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "checkpoints/last.pt",
        "tests/deploy/test_x.py",
        "runs/a/log.json",
        "service/__pycache__/cli.cpython-311.pyc",
        "export/__pycache__/model.cpython-311.pyc",
        "deploy/k8s/x.yaml",
        ".pytest_cache/v",
        ".ruff_cache/x",
        "qkv.egg-info/PKG-INFO",
        "docker-compose.yml",
    ],
)
def test_dockerignore_keeps_out(path: str) -> None:
    assert ignored(path, dockerignore()), path


@pytest.mark.parametrize(
    "path",
    [
        "pyproject.toml",
        "requirements/serve.txt",
        "requirements/cuda.txt",
        "README.md",
        "service/cli.py",
        "service/protocol/infer.binpb",
        "export/model.py",
        "export/data/split/test.txt",
        "models/g2p/config.json",
        "models/g2p/1/encoder.onnx",
    ],
)
def test_dockerignore_lets_in(path: str) -> None:
    assert not ignored(path, dockerignore()), path


@pytest.mark.parametrize("flavour", DOCKERFILES)
def test_every_copied_path_is_in_the_build_context(flavour: str) -> None:
    for stage in parse(DOCKERFILES[flavour]):
        for args in stage.all("COPY"):
            words = [w for w in args.split() if not w.startswith("--")]
            if any(w.startswith("--from=") for w in args.split()):
                continue
            for source in words[:-1]:
                assert not ignored(source.rstrip("/"), dockerignore()), f"{source} is excluded by .dockerignore"
                # models/ is exported by `qkv export` and README.md written with the project.
                if source.rstrip("/") not in {"models", "README.md"}:
                    assert (ROOT / source).exists(), source


# --- build.sh --------------------------------------------------------------------------

FAKE_DOCKER = """#!/usr/bin/env bash
{ echo "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH"; printf '%s\\n' "$@"; echo "--END--"; } >> "$DOCKER_LOG"
"""


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A throwaway git repository holding the files build.sh reads (never the project's)."""
    git = tool("git")
    work = tmp_path / "repo"
    (work / "deploy" / "docker").mkdir(parents=True)
    (work / "models" / "g2p").mkdir(parents=True)
    (work / "models" / "g2p" / "config.json").write_text("{}\n")
    for name in ("build.sh", "Dockerfile", "Dockerfile.cuda"):
        shutil.copy(DOCKER / name, work / "deploy" / "docker" / name)
    shutil.copy(ROOT / "pyproject.toml", work / "pyproject.toml")
    env = {
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_DATE": "2026-01-02T03:04:05Z",
        "GIT_COMMITTER_DATE": "2026-01-02T03:04:05Z",
    }
    ok(run([git, "init", "-q", "-b", "main", str(work)], env=env))
    ok(run([git, "add", "-A"], cwd=work, env=env))
    ok(
        run(
            [git, "-c", "user.name=t", "-c", "user.email=t@example.invalid", "commit", "-q", "-m", "x"],
            cwd=work,
            env=env,
        )
    )
    return work


def fake_build(repo: Path, *args: str, **env: str) -> tuple[int, list[list[str]], str]:
    fake = repo.parent / "docker"
    fake.write_text(FAKE_DOCKER)
    fake.chmod(0o755)
    log = repo.parent / "docker.log"
    proc = run(
        [tool("bash"), str(repo / "deploy" / "docker" / "build.sh"), *args],
        cwd=repo.parent,
        env={"DOCKER": str(fake), "DOCKER_LOG": str(log), "GIT_CONFIG_GLOBAL": os.devnull, **env},
    )
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("--END--") if c.strip()] if log.exists() else []
    return proc.returncode, calls, proc.stderr


def flag_values(call: list[str], flag: str) -> list[str]:
    return [call[i + 1] for i, a in enumerate(call) if a == flag]


def test_build_sh_is_valid_bash() -> None:
    ok(run([tool("bash"), "-n", str(DOCKER / "build.sh")]))
    assert os.access(DOCKER / "build.sh", os.X_OK), "chmod +x deploy/docker/build.sh"


def test_build_sh_tags_by_version_and_commit_and_pins_the_time(repo: Path) -> None:
    rc, calls, err = fake_build(repo, "all")
    assert rc == 0, err
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sha = run(["git", "rev-parse", "--short=12", "HEAD"], cwd=repo).stdout.strip()
    epoch = run(["git", "log", "-1", "--format=%ct"], cwd=repo).stdout.strip()
    assert epoch == "1767323045"
    assert len(calls) == 2
    for call, dockerfile, suffix in zip(calls, ["Dockerfile", "Dockerfile.cuda"], ["", "-cuda"], strict=True):
        assert call[0] == f"SOURCE_DATE_EPOCH={epoch}"  # exported to the docker CLI as well
        assert call[1:3] == ["buildx", "build"]
        assert flag_values(call, "--file") == [f"deploy/docker/{dockerfile}"]
        assert flag_values(call, "--tag") == [f"qkv:{version}-{sha}{suffix}", f"qkv:{version}{suffix}"]
        build_args = flag_values(call, "--build-arg")
        assert f"SOURCE_DATE_EPOCH={epoch}" in build_args and f"VERSION={version}" in build_args
        assert "rewrite-timestamp=true" in flag_values(call, "--output")[0]
        assert "--provenance=false" in call
        assert flag_values(call, "--label") == ["org.opencontainers.image.created=2026-01-02T03:04:05Z"]
        assert call[-1] == "."


def test_build_sh_marks_a_dirty_tree_and_pushes_on_request(repo: Path) -> None:
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# local change\n")
    rc, calls, err = fake_build(repo, "cpu", QKV_PUSH="1", QKV_IMAGE="registry.example/qkv")
    assert rc == 0, err
    [call] = calls
    assert flag_values(call, "--tag")[0].endswith("-dirty")
    assert flag_values(call, "--tag")[0].startswith("registry.example/qkv:")
    assert flag_values(call, "--output") == ["type=image,push=true,rewrite-timestamp=true"]


def test_build_sh_refuses_without_models_or_with_a_bad_target(repo: Path) -> None:
    rc, calls, _ = fake_build(repo, "arm")
    assert rc == 2 and not calls
    shutil.rmtree(repo / "models")
    rc, calls, err = fake_build(repo)
    assert rc == 1 and not calls and "models/ is missing" in err
