#!/usr/bin/env bash
# Set up a virtual environment in .venv with TensorHub (CPU / TCP data plane) and its
# test tools. Idempotent; safe to run again. Needs root (or sudo) once for libibverbs1.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1 '; then
  echo "installing Debian's libibverbs1 (Mooncake's wheel links it even for TCP)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# torch first, pinned: the CPU build (an unpinned torch pulls a multi-GB CUDA build).
.venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
.venv/bin/pip install -q --disable-pip-version-check -e '.[cpu,test]'
