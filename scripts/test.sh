#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export GLOG_minloglevel=2
# Two workers (pytest-xdist), a test file per worker at a time (tests/conftest.py groups them;
# three ran 27 min instead of 33, but their engines together ran the 24 GiB machine out of
# memory: the kernel killed a vLLM worker);
# TENSORHUB_TEST_WORKERS=0 runs them in this one process. Then, in this process with nothing
# beside them, the tests marked `alone`: what they check tilts on a loaded machine (plans that
# form in a 50 ms window, poll caps measured in milliseconds). Arguments go to both runs.
py=(.venv/bin/python -m pytest -q -p no:cacheprovider)
status=0
"${py[@]}" --durations=15 -n "${TENSORHUB_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder \
  -m "not alone" "$@" || status=$?
alone=0
"${py[@]}" --durations=5 -m alone "$@" || alone=$?
# 5: no test selected (arguments that name only tests of one kind)
if [ "$status" -eq 5 ] && [ "$alone" -eq 5 ]; then exit 5; fi
[ "$status" -eq 5 ] && status=0
[ "$alone" -eq 5 ] && alone=0
[ "$status" -ne 0 ] && exit "$status"
exit "$alone"
