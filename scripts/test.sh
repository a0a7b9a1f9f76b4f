#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2
# Two workers (pytest-xdist), a test file per worker at a time (tests/conftest.py groups them);
# TENSORHUB_TEST_WORKERS=0 runs it in this one process.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${TENSORHUB_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
