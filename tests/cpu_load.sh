#!/usr/bin/env bash
# Runs a command while every core is kept busy, so that a test whose result depends on the machine's
# speed shows itself (`make test-loaded` runs the whole suite this way).
#
#   tests/cpu_load.sh CMD [ARGS...]
#
# The load is Debian's stress-ng (installed when missing: needs root), one CPU worker per core
# (QKV_LOAD_CPUS overrides), at normal priority. It is stopped by its PID when the command ends,
# whether it passed or not; the command's exit status is kept.
set -uo pipefail
if ! command -v stress-ng >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq stress-ng >/dev/null
fi
stress-ng --cpu "${QKV_LOAD_CPUS:-$(nproc)}" --timeout 7200 --quiet &
load=$!
echo "cpu_load: stress-ng --cpu ${QKV_LOAD_CPUS:-$(nproc)} running (pid $load)" >&2
trap 'kill "$load" 2>/dev/null; wait "$load" 2>/dev/null; echo "cpu_load: stopped stress-ng (pid $load)" >&2' EXIT
"$@"
