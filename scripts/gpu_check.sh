#!/usr/bin/env bash
# The GPU check (issue 18; benchmarks/gpu_check.py says what it checks). On the device
# machine, carrying gpu_wheels/ (made here by scripts/fetch_gpu_wheels.sh):
#
#   bash scripts/gpu_check.sh            # figures and verdict in $OUT (default out/gpu_check)
#
# 1. With a CUDA GPU, installs the carried wheels offline into a private folder put first on
#    PYTHONPATH (the device's Python and its packages stay untouched): TensorHub's
#    dependencies and the CUDA 13 build of Mooncake; TensorHub itself runs from this tree.
#    Without a GPU it uses the Python it is given as is (PYTHON=.venv/bin/python here).
# 2. Puts torch's CUDA runtime, and the carried copies of any system library Mooncake's
#    engine.so lacks on this machine, on LD_LIBRARY_PATH.
# 3. Runs benchmarks/gpu_check.py (data plane over TCP and, when the wheel has it, NVLink;
#    the engine-native layout; figures), then the `gpu`-marked tests if pytest is present.
# Without a GPU it says so, runs the same steps on CPU tensors and exits 0 when they pass.
# Any failure exits non-zero with the reason on the last line.
#
# Environment: PYTHON (default: python3 or python, the first with torch), OUT, GPU_CHECK_WORK
# (scratch, default /tmp/tensorhub-gpu-check), GPU_CHECK_PYTEST=0 skips step 3's tests,
# GPU_CHECK_INSTALL_ONLY=1 runs steps 1-2 alone, with or without a GPU, and checks what got
# installed. Arguments go to `gpu_check.py run` (e.g. --mib 1024).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
if [ -z "${PYTHON:-}" ]; then  # the first Python on PATH that has torch
    for p in python3 python; do
        if command -v "$p" >/dev/null && "$p" -c "import torch" 2>/dev/null; then PYTHON=$(command -v "$p"); break; fi
    done
    PYTHON=${PYTHON:-$(command -v python3 || command -v python)}
fi
export OUT=${OUT:-out/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/tensorhub-gpu-check}
WHEELS=$ROOT/gpu_wheels
export GLOG_minloglevel=${GLOG_minloglevel:-2}
mkdir -p "$OUT" "$WORK"
fail() { echo "GPU CHECK FAILED: $*" >&2; exit 1; }
t0=$(date +%s)

info=$("$PYTHON" -c 'import sys, torch; print(int(torch.cuda.is_available()), sys.version.split()[0], torch.__version__, torch.version.cuda)') \
    || fail "$PYTHON cannot import torch"
read -r gpu pyver torchver torchcuda <<<"$info"
echo "gpu_check.sh: $PYTHON: Python $pyver, torch $torchver (CUDA $torchcuda); GPU available: $gpu"

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [ "$gpu" = 1 ] || [ "${GPU_CHECK_INSTALL_ONLY:-0}" = 1 ]; then
    [ -d "$WHEELS" ] || fail "gpu_wheels/ is missing: run 'bash scripts/fetch_gpu_wheels.sh' where PyPI is reachable and carry gpu_wheels"
    SITE=$WORK/site
    rm -rf "$SITE"
    mapfile -t reqs < <("$PYTHON" benchmarks/gpu_check.py requirements)
    mooncake=$("$PYTHON" benchmarks/gpu_check.py requirements --mooncake)
    echo "gpu_check.sh: installing ${reqs[*]} $mooncake from gpu_wheels/ into $SITE"
    PIP_CONSTRAINT= "$PYTHON" -m pip install -q --disable-pip-version-check --no-warn-conflicts --no-index --find-links "$WHEELS" \
        --only-binary=:all: --target "$SITE" "${reqs[@]}" "$mooncake" \
        || fail "pip could not install the carried wheels (is Python $pyver among 3.10-3.13?)"
    tar xzf "$WHEELS"/mooncake-libs-*.tar.gz -C "$SITE" || fail "could not unpack gpu_wheels/mooncake-libs-*.tar.gz"
    export PYTHONPATH="$SITE:$PYTHONPATH"
    libs=$("$PYTHON" benchmarks/gpu_check.py libpath "$SITE" --wheels "$WHEELS" --work "$WORK/libs")
    export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    echo "gpu_check.sh: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    if [ "${GPU_CHECK_INSTALL_ONLY:-0}" = 1 ]; then  # the install step alone (tests/test_gpu_check.py, no GPU)
        "$PYTHON" - "$SITE" <<'PY' || fail "the installed packages do not come from gpu_wheels/"
import importlib, sys
site = sys.argv[1]
for name in ("pydantic", "pydantic_core", "fastapi", "starlette", "uvicorn", "httpx", "prometheus_client", "xxhash",
             "mooncake"):
    path = importlib.import_module(name).__file__
    assert path.startswith(site), f"{name} imports from {path}, not {site}"
print(f"gpu_check.sh: installed from gpu_wheels/ into {site}: TensorHub's dependencies and mooncake "
      "(its engine.so needs the GPU machine's libcuda.so.1 to load)")
PY
        exit 0
    fi
else
    echo "gpu_check.sh: no CUDA GPU here: nothing installed; running the CPU-possible parts with $PYTHON"
    "$PYTHON" -c "import fastapi, pydantic, uvicorn, httpx, prometheus_client, xxhash, mooncake.engine" \
        || fail "$PYTHON lacks TensorHub's dependencies or Mooncake (without a GPU, run it with the project's venv: PYTHON=.venv/bin/python)"
fi

rc=0
"$PYTHON" benchmarks/gpu_check.py run --out "$OUT" "$@" || rc=$?

if [ "${GPU_CHECK_PYTEST:-1}" != 0 ] && "$PYTHON" -c "import pytest" 2>/dev/null; then
    mapfile -t files < <(grep -rlE "pytest\.mark\.gpu|mark\.gpu\b" tests --include='test_*.py' | sort)
    echo "gpu_check.sh: pytest -m gpu ${files[*]}"
    prc=0
    "$PYTHON" -m pytest -q -p no:cacheprovider -rs -m gpu "${files[@]}" >"$OUT/pytest_gpu.txt" 2>&1 || prc=$?
    tail -n 15 "$OUT/pytest_gpu.txt"
    # 5: nothing selected (no gpu test left in those files) is not a failure.
    if [ "$prc" != 0 ] && [ "$prc" != 5 ]; then
        echo "gpu_check.sh: pytest -m gpu failed (exit $prc): $OUT/pytest_gpu.txt" >&2
        [ "$rc" != 0 ] || rc=$prc
    fi
else
    echo "gpu_check.sh: pytest -m gpu not run (pytest absent or GPU_CHECK_PYTEST=0)" | tee "$OUT/pytest_gpu.txt"
fi

echo "gpu_check.sh: $(( $(date +%s) - t0 ))s; figures in $OUT/gpu_check.txt and $OUT/gpu_check.json"
[ "$rc" = 0 ] || fail "exit $rc (see above and $OUT/gpu_check.json)"
echo "gpu_check.sh: OK ($([ "$gpu" = 1 ] && echo "on the GPU" || echo "CPU mode: no GPU here, the device calls were not made"))"
