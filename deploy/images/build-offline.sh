#!/usr/bin/env bash
# Build the gateway image with no container registry and no network during the build:
#   1. a Debian bookworm root filesystem made by mmdebstrap from Debian's packages, imported as the base;
#   2. every wheel downloaded beforehand with pip into deploy/images/wheels/;
#   3. podman build --network=none from those two.
# Usage: deploy/images/build-offline.sh [TAG]   (default yieldgate-gateway:0.1.0)
# Environment: WORK (default ~/.cache/yieldgate/image-build) keeps the root filesystem between runs;
# PYTHON (default python3, a 3.11 like the base's) downloads the wheels.
# Needs podman, runc and mmdebstrap (Debian: apt-get install podman runc mmdebstrap), run as root.
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-yieldgate-gateway:0.1.0}
WORK=${WORK:-${YIELDGATE_HOME:-$HOME/.cache/yieldgate}/image-build}
PYTHON=${PYTHON:-python3}
BASE=localhost/yieldgate-base:bookworm
WHEELS=deploy/images/wheels
# podman 4.3 (bookworm) on these hosts runs containers with runc. Its default rlimits (nofile
# 1048576, nproc from the host) are refused where the host's own limits are lower ("error setting
# rlimit type 7 / 6: operation not permitted"): ask for the open-file limit this shell has and a
# modest process limit (pip needs few).
PODMAN=(podman --runtime runc)
ULIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)

say() { printf '[build-offline] %s\n' "$*" >&2; }
mkdir -p "$WORK"
t0=$SECONDS

if ! "${PODMAN[@]}" image exists "$BASE"; then
  if [ ! -s "$WORK/rootfs.tar" ]; then
    say "root filesystem: mmdebstrap bookworm (python3, python3-venv)"
    mmdebstrap --quiet --format=tar --variant=minbase --include=python3,python3-venv,ca-certificates \
      --aptopt='Acquire::Languages "none"' \
      --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
      bookworm "$WORK/rootfs.tar.tmp"
    mv "$WORK/rootfs.tar.tmp" "$WORK/rootfs.tar"
  fi
  say "importing $BASE"
  "${PODMAN[@]}" import --change 'CMD ["/bin/bash"]' "$WORK/rootfs.tar" "$BASE" >/dev/null
fi
t1=$SECONDS

say "wheels into $WHEELS"
# The project's dependencies, resolved from pyproject.toml (pip builds its metadata here, with
# network), with torch held to the CPU build the Containerfile installs; and the build backend.
echo "torch==2.13.0+cpu" > "$WORK/constraints.txt"
"$PYTHON" -m pip download --quiet --disable-pip-version-check -d "$WHEELS" -c "$WORK/constraints.txt" \
  . torch==2.13.0+cpu "setuptools>=68" wheel \
  "async-timeout>=4.0.3"  # redis needs it below Python 3.11.3: bookworm has 3.11.2, this host may not
rm -f "$WHEELS"/yieldgate-*   # the image builds yieldgate from the sources in the context
t2=$SECONDS

say "podman build $TAG (no network)"
"${PODMAN[@]}" build --network=none "${ULIMITS[@]}" --pull=never \
  --build-arg BASE="$BASE" --build-arg PIP_NO_INDEX=1 \
  -f deploy/images/gateway.Containerfile -t "$TAG" .
t3=$SECONDS
say "done in $((t3 - t0)) s: base $((t1 - t0)) s, wheels $((t2 - t1)) s, build $((t3 - t2)) s"
