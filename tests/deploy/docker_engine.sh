#!/usr/bin/env bash
# Runs a command with a Docker engine for the compose tests (tests/deploy/test_deploy_stack.py).
#
#   tests/deploy/docker_engine.sh CMD [ARGS...]
#
# An engine that already answers is used as it is. Otherwise, where dockerd is installed and this
# runs as root, one is started for the command and stopped by its PID afterwards. Either way, what
# this run's tests made is removed when the command ends, whether it passed or not, and nothing else:
# the run has an id (QKV_TEST_RUN, exported to the command; made here unless given), and the tests
# name what they make after it: containers labelled org.qkv.test.run=ID, compose projects qkvtIDp*,
# images qkv:testIDp* (tests/deploy/deploy_helpers.py). Another checkout's run on the same engine, with
# an id of its own, keeps its containers, networks and images. The command's exit status is kept.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
started=""
QKV_TEST_RUN=${QKV_TEST_RUN:-$(od -An -N6 -tx1 /dev/urandom | tr -d ' \n')}
case $QKV_TEST_RUN in  # hexadecimal: no "p", so that one run's prefix is never the start of another's
  *[!0-9a-f]* | "") echo "docker_engine: QKV_TEST_RUN must be lowercase hexadecimal, not '$QKV_TEST_RUN'" >&2
                    exit 2 ;;
esac
export QKV_TEST_RUN

# This run's names among those listed on stdin (one a line): the ones that start with PREFIX.
ours() {
  local prefix=$1 name
  while IFS= read -r name; do
    case $name in "$prefix"*) echo "$name" ;; esac
  done
}

cleanup() {
  local project image
  if docker info >/dev/null 2>&1; then
    docker ps -aq --filter "label=org.qkv.test.run=$QKV_TEST_RUN" | xargs -r docker rm -f >/dev/null 2>&1
    for project in $( { docker ps -a --format '{{.Label "com.docker.compose.project"}}';
                        docker network ls --format '{{.Label "com.docker.compose.project"}}'; } \
                      | ours "qkvt${QKV_TEST_RUN}p" | sort -u); do
      docker-compose -p "$project" -f "$root/docker-compose.yml" down -v --remove-orphans >/dev/null 2>&1
    done
    for image in $(docker image ls --format '{{.Repository}}:{{.Tag}}' | ours "qkv:test${QKV_TEST_RUN}p" | sort -u); do
      docker image rm "$image" >/dev/null 2>&1
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
