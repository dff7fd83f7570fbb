#!/usr/bin/env bash
# Installs ddiloco and its test tools into ./.venv. Idempotent: a second run takes seconds.
# pip is told --no-compile: byte-compiling every file of torch and transformers took about half of a fresh
# install (58 s with it off, 110 s on); Python compiles what is imported, once, on first use.
#
# PyTorch: if .venv has no torch yet, this installs $DDILOCO_TORCH (default "torch==2.13.0", which on
# machines that carry the CPU wheel locally takes that wheel and no CUDA packages). GPU users who want a
# particular CUDA build set e.g. DDILOCO_TORCH="torch --index-url https://download.pytorch.org/whl/cu128"
# or install torch into .venv themselves before running this.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)" >&2
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${DDILOCO_TORCH:-torch==2.13.0}" >&2
  # shellcheck disable=SC2086  # DDILOCO_TORCH may carry pip options
  "$VPY" -m pip install -q --no-compile --disable-pip-version-check ${DDILOCO_TORCH:-torch==2.13.0}
fi
# The editable install is done once per pyproject.toml: its hash is stamped into .venv and a second run skips
# pip (delete .venv/.ddiloco-installed to install again)
STAMP=.venv/.ddiloco-installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "setup: installing ddiloco (editable) with test tools and the [hf] and [remote] extras" >&2
  # torch is already in .venv at this point, and transformers does not require it, so pip keeps that build.
  "$VPY" -m pip install -q --no-compile --disable-pip-version-check -e ".[dev,hf,remote]"
  "$VPY" -c "import torch, transformers, tokenizers, pyarrow, libp2p" # fail here, not in the tests, if one is missing
  echo "$WANT" > "$STAMP"
fi
