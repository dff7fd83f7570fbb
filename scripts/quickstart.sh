#!/usr/bin/env bash
# The main job on the embedded default: installs into ./.venv, then trains a 4-learner swarm.
# Extra arguments go to `ddiloco train-local` (e.g. --system decoupled,dp to compare with data-parallel).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ddiloco train-local "$@"
