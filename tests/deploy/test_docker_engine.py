"""tests/deploy/docker_engine.sh's cleanup removes what its own run made and nothing of another run's.

No engine is needed: `docker` and `docker-compose` are stand-ins on PATH that list the containers,
networks and images of two runs on one engine (this one's and another checkout's) and record what
the script asks of them. The script itself runs as `make test` runs it.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from deploy_helpers import ROOT

SCRIPT = ROOT / "tests" / "deploy" / "docker_engine.sh"
MINE, OTHER = "a1b2c3", "a1b2c3d4"  # the other run's id starts with this one's
# What the engine holds: containers by run label, compose projects (by their containers, and one by its
# network alone), images; the stand-in answers a label filter as the engine does.
FAKE_DOCKER = r"""#!/usr/bin/env bash
echo "docker $*" >> "$CALLS"
case "$1" in
  info) exit 0 ;;
  ps)
    case "$*" in
      *"label=org.qkv.test.run=$MINE"*) echo c-mine ;;
      *"label=org.qkv.test.run=$OTHER"*) echo c-other ;;
      *"label=org.qkv.test=true"*) printf 'c-mine\nc-other\n' ;;
      *com.docker.compose.project*) printf 'qkvt%sp11\nqkvt%sp11\nqkvt%sp22\n\nunrelated\n' "$MINE" "$MINE" "$OTHER" ;;
    esac ;;
  network) printf 'qkvt%sp11\nqkvt%sp12\nqkvt%sp33\n\n' "$MINE" "$MINE" "$OTHER" ;;
  image) [ "$2" = ls ] && printf 'qkv:test%sp11\nqkv:test%sp22\nqkv:0.1.0\npython:3.11-slim\n' "$MINE" "$OTHER" ;;
esac
exit 0
"""
FAKE_COMPOSE = """#!/usr/bin/env bash
echo "docker-compose $*" >> "$CALLS"
"""


def run_script(tmp_path: Path, command: str, run_id: str | None) -> tuple[subprocess.CompletedProcess[str], list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("docker", FAKE_DOCKER), ("docker-compose", FAKE_COMPOSE)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "MINE": MINE, "OTHER": OTHER}
    env.pop("QKV_TEST_RUN", None)
    if run_id is not None:
        env["QKV_TEST_RUN"] = run_id
    done = subprocess.run(["bash", str(SCRIPT), "bash", "-c", command], capture_output=True, text=True, env=env,
                          timeout=60)  # fmt: skip
    return done, calls.read_text().splitlines()


def test_cleanup_removes_this_runs_containers_projects_and_images_only(tmp_path: Path) -> None:
    done, calls = run_script(tmp_path, 'echo "run=$QKV_TEST_RUN"; exit 3', MINE)
    assert done.returncode == 3, done.stderr  # the command's status is kept
    assert done.stdout.strip() == f"run={MINE}"  # the tests name what they make after this id
    removed = [c for c in calls if " rm " in f" {c} " or c.startswith("docker-compose")]
    assert removed == [
        "docker rm -f c-mine",
        f"docker-compose -p qkvt{MINE}p11 -f {ROOT / 'docker-compose.yml'} down -v --remove-orphans",
        f"docker-compose -p qkvt{MINE}p12 -f {ROOT / 'docker-compose.yml'} down -v --remove-orphans",
        f"docker image rm qkv:test{MINE}p11",
    ], calls
    assert not any("label=org.qkv.test=true" in c for c in calls), calls  # never every test container


def test_a_run_without_an_id_gets_one_and_a_bad_id_is_refused(tmp_path: Path) -> None:
    done, calls = run_script(tmp_path, 'echo "$QKV_TEST_RUN"', None)
    run_id = done.stdout.strip()
    assert done.returncode == 0 and len(run_id) == 12 and int(run_id, 16) >= 0, done
    assert f"docker ps -aq --filter label=org.qkv.test.run={run_id}" in calls
    assert not any(c.startswith(("docker rm", "docker-compose", "docker image rm")) for c in calls), calls
    bad, calls = run_script(tmp_path, "true", "qkvt*")
    assert bad.returncode == 2 and "QKV_TEST_RUN must be lowercase hexadecimal" in bad.stderr
    assert calls == []  # refused before anything was asked of the engine
