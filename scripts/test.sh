#!/usr/bin/env bash
# The test suite: installs into ./.venv if needed, then runs pytest. Extra arguments go to pytest.
# The swarm tests mostly wait on rounds, timeouts and start-ups, so two pytest-xdist workers share the cores;
# DDILOCO_TEST_WORKERS=0 runs everything in one process (e.g. with a debugger).
# --fast: the inner loop's tier, every test not marked ``slow`` (no node processes, nothing that trains for
# more than a few seconds).
set -euo pipefail
cd "$(dirname "$0")/.."
args=()
for a in "$@"; do
  if [ "$a" = "--fast" ]; then args+=(-m "not slow"); else args+=("$a"); fi
done
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n "${DDILOCO_TEST_WORKERS:-2}" --dist worksteal ${args[@]+"${args[@]}"}
