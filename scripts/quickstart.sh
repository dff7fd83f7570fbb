#!/usr/bin/env bash
# The main job on the embedded default: installs into ./.venv, then runs a local swarm of 3 real node
# processes (DHT discovery, elected synchronisers) training a small model for 60 s, with a live status table.
# Extra arguments go to `ddiloco up` (e.g. --nodes 4 --duration 120, or --duration 0 to run until Ctrl+C).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ddiloco up --nodes 3 --duration 60 "$@"
