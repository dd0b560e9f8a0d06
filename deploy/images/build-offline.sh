#!/usr/bin/env bash
# Build the gateway image with no container registry and no network during the build:
#   1. a base root filesystem of Debian bookworm's python3 by mmdebstrap, imported into podman;
#   2. the yieldgate wheel built here, and wheels of the dependencies as PYTHON's environment has
#      them installed (deploy/images/stage_wheels.py), into deploy/images/wheels/;
#   3. podman build --network=none of deploy/images/gateway.Containerfile from those two.
# Usage: deploy/images/build-offline.sh [TAG]   (default yieldgate-gateway:0.1.0)
# Environment: WORK (default ~/.cache/yieldgate/image-build) keeps the root filesystem between runs;
# PYTHON (default .venv/bin/python, a 3.11 like the base's, with yieldgate's dependencies installed:
# `scripts/dev` makes it) builds the wheel and gives the dependencies, in the versions it runs.
# Needs podman, runc and mmdebstrap (Debian: apt-get install podman runc mmdebstrap), run as root.
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${1:-yieldgate-gateway:0.1.0}
WORK=${WORK:-${YIELDGATE_HOME:-$HOME/.cache/yieldgate}/image-build}
PYTHON=${PYTHON:-.venv/bin/python}
# The base's tag names its recipe (this script's mmdebstrap line): a changed recipe is rebuilt.
BASE=localhost/yieldgate-base:bookworm-$(sed -n '/^    mmdebstrap /,/^      bookworm /p' "$0" | sha256sum | cut -c1-12)
WHEELS=deploy/images/wheels
# podman 4.3 (bookworm) on these hosts runs containers with runc. Its default rlimits (nofile
# 1048576, nproc from the host) are refused where the host's own limits are lower ("error setting
# rlimit type 7 / 6: operation not permitted"): ask for the open-file limit this shell has and a
# modest process limit (pip needs few).
PODMAN=(podman --runtime runc)
ULIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit nproc=4096:4096)

t0=$SECONDS
say() { printf '[build-offline %3d s] %s\n' $((SECONDS - t0)) "$*" >&2; }
mkdir -p "$WORK"

if ! "${PODMAN[@]}" image exists "$BASE"; then
  if [ ! -s "$WORK/${BASE##*:}.tar" ]; then
    say "root filesystem: mmdebstrap bookworm (python3, python3-venv, ca-certificates, passwd)"
    # The extract variant unpacks the packages and runs no maintainer script: seconds instead of
    # the minute dpkg spends configuring. The hooks do what those scripts would have done that the
    # image needs: the base users and groups, and the CA bundle (Debian's certificates only).
    mmdebstrap --quiet --format=tar --variant=extract \
      --include=python3,python3-venv,libstdc++6,ca-certificates,passwd,login,base-passwd,dash,coreutils \
      --aptopt='Acquire::Languages "none"' \
      --extract-hook='cp "$1"/usr/share/base-passwd/passwd.master "$1"/etc/passwd' \
      --extract-hook='cp "$1"/usr/share/base-passwd/group.master "$1"/etc/group' \
      --extract-hook='cat "$1"/usr/share/ca-certificates/mozilla/*.crt > "$1"/etc/ssl/certs/ca-certificates.crt' \
      --extract-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/* "$1"/usr/share/doc "$1"/usr/share/man' \
      bookworm "$WORK/rootfs.tar.tmp"
    mv "$WORK/rootfs.tar.tmp" "$WORK/${BASE##*:}.tar"
  fi
  say "importing $BASE"
  "${PODMAN[@]}" import --change 'CMD ["/bin/sh"]' "$WORK/${BASE##*:}.tar" "$BASE" >/dev/null
fi
t1=$SECONDS

say "wheels into $WHEELS"
rm -f "$WHEELS"/*.whl
"$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w "$WHEELS" .
# bookworm's Python is 3.11.2: requirement markers are evaluated for it (redis then needs async-timeout).
"$PYTHON" deploy/images/stage_wheels.py "$WHEELS" "$WHEELS"/yieldgate-*.whl --python 3.11.2 >&2
t2=$SECONDS

say "podman build $TAG (no network)"
# --layers=false: one commit for the whole build, not one per instruction.
"${PODMAN[@]}" build --network=none "${ULIMITS[@]}" --pull=never --layers=false \
  --build-arg BASE="$BASE" --build-arg PIP_NO_INDEX=1 --build-arg SOURCE=yieldgate \
  -f deploy/images/gateway.Containerfile -t "$TAG" .
t3=$SECONDS
say "done in $((t3 - t0)) s: base $((t1 - t0)) s, wheels $((t2 - t1)) s, build $((t3 - t2)) s"
