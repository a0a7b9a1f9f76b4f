#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo: embedded coordinator, a publisher, two readers.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2
exec .venv/bin/python examples/demo.py "$@"
