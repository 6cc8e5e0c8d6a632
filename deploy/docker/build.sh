#!/usr/bin/env bash
# Reproducible build of the qkv images (needs Docker with BuildKit/buildx).
#
#   deploy/docker/build.sh [cpu|cuda|all]      (default: cpu)
#
# Tags:   ${QKV_IMAGE:-qkv}:<version>-<sha>  and  :<version>      (cpu)
#         ${QKV_IMAGE:-qkv}:<version>-<sha>-cuda and :<version>-cuda (cuda)
#         <version> from pyproject.toml, <sha> = git short sha of HEAD
#         (+ "-dirty" when the work tree has uncommitted changes).
# Time:   SOURCE_DATE_EPOCH = the last commit's time; BuildKit uses it for the image
#         config and, with rewrite-timestamp, for every file in the layers.
#
# Environment:
#   QKV_IMAGE      image name, e.g. ghcr.io/acme/qkv (default qkv)
#   QKV_PUSH=1     push to the registry instead of loading into the local engine
#   QKV_PLATFORM   target platform (default linux/amd64)
#   DOCKER         docker CLI to call (default docker)
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
cd "$root"

target=${1:-cpu}
case $target in
  cpu | cuda | all) ;;
  *) echo "usage: $0 [cpu|cuda|all]" >&2; exit 2 ;;
esac

image=${QKV_IMAGE:-qkv}
platform=${QKV_PLATFORM:-linux/amd64}
docker=${DOCKER:-docker}

if ! git rev-parse --verify -q HEAD >/dev/null; then
  echo "build.sh: no commit yet; images are tagged and timestamped by the last commit" >&2
  exit 1
fi
[ -d models ] || { echo "build.sh: models/ is missing: export the model repository first (qkv export)" >&2; exit 1; }

version=$(sed -n 's/^version[[:space:]]*=[[:space:]]*"\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
[ -n "$version" ] || { echo "build.sh: no version in pyproject.toml" >&2; exit 1; }
sha=$(git rev-parse --short=12 HEAD)
revision=$(git rev-parse HEAD)
if [ -n "$(git status --porcelain --untracked-files=no)" ]; then
  sha="$sha-dirty"
  echo "build.sh: warning: uncommitted changes; tagging $sha" >&2
fi
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
export SOURCE_DATE_EPOCH
created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ 2>/dev/null || date -u -r "$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)

if [ "${QKV_PUSH:-0}" = 1 ]; then
  output="type=image,push=true,rewrite-timestamp=true"
else
  output="type=docker,rewrite-timestamp=true"
fi

build() { # build DOCKERFILE SUFFIX
  local dockerfile=$1 suffix=$2
  echo "build.sh: $image:$version-$sha$suffix (SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH)" >&2
  "$docker" buildx build \
    --file "$dockerfile" \
    --platform "$platform" \
    --build-arg "SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH" \
    --build-arg "VERSION=$version" \
    --build-arg "REVISION=$revision" \
    --label "org.opencontainers.image.created=$created" \
    --provenance=false \
    --sbom=false \
    --output "$output" \
    --tag "$image:$version-$sha$suffix" \
    --tag "$image:$version$suffix" \
    .
}

case $target in
  cpu) build deploy/docker/Dockerfile "" ;;
  cuda) build deploy/docker/Dockerfile.cuda -cuda ;;
  all) build deploy/docker/Dockerfile "" && build deploy/docker/Dockerfile.cuda -cuda ;;
esac
