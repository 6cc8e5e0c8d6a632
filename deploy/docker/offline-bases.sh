#!/usr/bin/env bash
# Local stand-ins for the public base images, for a Docker engine that cannot reach a registry.
#
#   deploy/docker/offline-bases.sh            # build what is missing (idempotent, quick when cached)
#   deploy/docker/offline-bases.sh --force    # rebuild all of them
#
# Builds, under the exact tags that deploy/docker/Dockerfile and docker-compose.yml name, so
# that both are used unchanged:
#   python:<tag>       Debian bookworm (minbase) with Debian's python3, python3-venv, python3-pip,
#                      and a wheelhouse of exactly the wheels locked in requirements/serve.txt
#                      (hash-checked, as the Dockerfile installs them) plus the build backend
#                      that pyproject.toml names (pip inside a container cannot reach the index:
#                      PIP_NO_INDEX=1 and PIP_FIND_LINKS point at the wheelhouse);
#   prom/prometheus:<tag>  the same rootfs with Debian's prometheus package (2.42; the compose
#                      file's flags are the same), entrypoint /usr/bin/prometheus, user nobody.
# Grafana has no stand-in: no Grafana build is reachable from Debian or PyPI.
#
# Needs root, debootstrap, and the host's pip able to reach the package index. The Debian
# mirror is the host's own (DEBIAN_MIRROR overrides it). Every stand-in carries the label
# org.qkv.standin=true; `docker image ls -f label=org.qkv.standin` lists them.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
docker=${DOCKER:-docker}
force=0
[ "${1:-}" = --force ] && force=1
log() { echo "offline-bases: $*" >&2; }
quietly() { "$@" >"$work/step.log" 2>&1 || { tail -20 "$work/step.log" >&2; exit 1; }; } # output only on failure

export DOCKER_BUILDKIT=0 # the classic builder: BuildKit's frontends come from a registry too

python_tag=$(sed -n 's/^FROM \(python:[^ ]*\) AS builder$/\1/p' "$root/deploy/docker/Dockerfile")
prometheus_tag=$(sed -n 's/^ *image: \(prom\/prometheus:[^ ]*\)$/\1/p' "$root/docker-compose.yml")
[ -n "$python_tag" ] && [ -n "$prometheus_tag" ] || { log "cannot read the base tags"; exit 1; }
rootfs_tag=qkv-standin/bookworm:minbase

# The wheelhouse follows the serving lock and the build backend: a change to either rebuilds the
# Python stand-in.
lock=$root/requirements/serve.txt
[ -f "$lock" ] || { log "$lock is missing (make lock)"; exit 1; }
build_requirements=$(python3 - "$root/pyproject.toml" <<'EOF'
import sys, tomllib
data = tomllib.load(open(sys.argv[1], "rb"))
print("\n".join([*data["build-system"]["requires"], "wheel"]))
EOF
)
requirements_sha=$({ printf '%s\n' "$build_requirements"; cat "$lock"; } | sha256sum | cut -c1-16)

have() { # have TAG [LABEL=VALUE]: the image exists (with that label value) and --force was not given
  [ "$force" = 0 ] || return 1
  local labels
  labels=$("$docker" image inspect -f '{{json .Config.Labels}}' "$1" 2>/dev/null) || return 1
  [ -z "${2:-}" ] || grep -q "\"${2%%=*}\":\"${2#*=}\"" <<<"$labels"
}

mirror() { # the host's Debian mirror, as apt is configured here
  if [ -n "${DEBIAN_MIRROR:-}" ]; then echo "$DEBIAN_MIRROR"; return; fi
  local uri
  uri=$(awk '/^URIs:/ && !/security/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $0 !~ /security/ {for (i = 2; i <= NF; i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' \
    /etc/apt/sources.list /etc/apt/sources.list.d/*.list 2>/dev/null || true)
  [ -n "$uri" ] || { log "no Debian mirror in the apt sources; set DEBIAN_MIRROR"; exit 1; }
  echo "$uri"
}

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! have "$rootfs_tag"; then
  command -v debootstrap >/dev/null || { log "debootstrap is missing: apt-get install -y debootstrap"; exit 1; }
  log "debootstrap bookworm (minbase) from $(mirror)"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python-is-python3,ca-certificates,wget \
    bookworm "$work/rootfs" "$(mirror)" >"$work/debootstrap.log" 2>&1 || { tail -20 "$work/debootstrap.log" >&2; exit 1; }
  rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/*
  tar -C "$work/rootfs" -c . | "$docker" import \
    -c 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
    -c 'LABEL org.qkv.standin=true' -c 'CMD ["bash"]' - "$rootfs_tag" >/dev/null
  rm -rf "$work/rootfs"
fi

if ! have "$python_tag" "org.qkv.standin.requirements=$requirements_sha"; then
  log "$python_tag: wheelhouse of requirements/serve.txt and the build backend"
  arch=$(uname -m)
  platforms=()
  for p in manylinux2014 manylinux_2_17 manylinux_2_27 manylinux_2_28 manylinux_2_34; do platforms+=(--platform "${p}_$arch"); done
  download=(python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp --abi cp311
    "${platforms[@]}" -d "$work/python/wheels")
  # The lock carries hashes: pip checks every wheel against them here already.
  mapfile -t build_reqs <<<"$build_requirements"
  { "${download[@]}" --require-hashes -r "$lock" && "${download[@]}" "${build_reqs[@]}"; } >"$work/pip.log" 2>&1 ||
    { tail -20 "$work/pip.log" >&2; exit 1; }
  cat >"$work/python/Dockerfile" <<EOF
FROM $rootfs_tag
COPY wheels /opt/wheels
ENV PIP_NO_INDEX=1 PIP_FIND_LINKS=/opt/wheels PIP_DISABLE_PIP_VERSION_CHECK=1
LABEL org.qkv.standin=true org.qkv.standin.requirements=$requirements_sha
CMD ["python3"]
EOF
  quietly "$docker" build -q -t "$python_tag" "$work/python"
fi

if ! have "$prometheus_tag"; then
  log "$prometheus_tag: Debian's prometheus"
  mkdir -p "$work/prometheus"
  cat >"$work/prometheus/Dockerfile" <<EOF
FROM $rootfs_tag
RUN printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \\
 && apt-get update -qq \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null \\
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/archives/*.deb \\
 && mkdir -p /prometheus /etc/prometheus && chown nobody:nogroup /prometheus
LABEL org.qkv.standin=true
USER nobody
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
EOF
  quietly "$docker" build -q --network host -t "$prometheus_tag" "$work/prometheus"
fi

log "ready: $python_tag $prometheus_tag"
