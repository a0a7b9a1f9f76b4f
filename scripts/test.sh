#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
