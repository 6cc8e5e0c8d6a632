#!/usr/bin/env bash
# Runs a command with a Docker engine for the compose tests (tests/deploy/test_deploy_stack.py).
#
#   tests/deploy/docker_engine.sh CMD [ARGS...]
#
# An engine that already answers is used as it is. Otherwise, where dockerd is installed and this
# runs as root, one is started for the command and stopped by its PID afterwards. Either way, what
# the tests made (their compose projects' containers, networks and volumes, their load clients) is
# removed when the command ends, whether it passed or not. The command's exit status is kept.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
started=""

cleanup() {
  local project
  if docker info >/dev/null 2>&1; then
    docker ps -aq --filter label=org.qkv.test=true | xargs -r docker rm -f >/dev/null 2>&1
    for project in $(docker ps -a --format '{{.Label "com.docker.compose.project"}}' | grep -E '^qkvt[0-9]+$' | sort -u); do
      docker-compose -p "$project" -f "$root/docker-compose.yml" down -v --remove-orphans >/dev/null 2>&1
    done
  fi
  if [ -n "$started" ]; then
    kill "$started" 2>/dev/null && wait "$started" 2>/dev/null
    echo "docker_engine: stopped the dockerd it started (pid $started)" >&2
  fi
}

if ! docker info >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v dockerd >/dev/null; then
  log=$(mktemp -t dockerd.XXXXXX.log)
  dockerd >"$log" 2>&1 &
  started=$!
  for _ in $(seq 120); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 && echo "docker_engine: started dockerd (pid $started, log $log)" >&2 \
    || echo "docker_engine: dockerd did not answer; see $log" >&2
fi
trap cleanup EXIT
"$@"
