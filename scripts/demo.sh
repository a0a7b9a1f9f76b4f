#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the demo: an embedded coordinator, a trainer that trains a tiny
# Llama and publishes each version, two vLLM engines following every version, a third joining
# midway. Summary table on stdout; out/demo.json, out/demo_timeline.png, out/logs/. See examples/demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2
exec .venv/bin/python examples/demo.py "$@"
