#!/usr/bin/env bash
# Installs ddiloco and its test tools into ./.venv. Idempotent: a second run takes seconds.
# The installer is uv (from PyPI, into .venv): a fresh install takes about 15 s with it against 58 s with pip,
# which unpacks and copies one file at a time. Where uv cannot be had or fails, pip does the same install.
# Neither byte-compiles (pip is told --no-compile): Python compiles what is imported, once, on first use.
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
# install ARGS...: uv where it is (it reads pip's --find-links from PIP_FIND_LINKS, where the CPU wheel of
# torch may lie), else pip; a failed uv install is retried by pip, which reads pip.conf as well.
if [ ! -x .venv/bin/uv ] && [ -z "${DDILOCO_NO_UV:-}" ]; then
  "$VPY" -m pip install -q --disable-pip-version-check uv >/dev/null 2>&1 || echo "setup: no uv; pip installs" >&2
fi
install() {
  if [ -x .venv/bin/uv ] && [ -z "${DDILOCO_NO_UV:-}" ]; then
    local links=()
    for d in ${PIP_FIND_LINKS:-}; do links+=(--find-links "$d"); done
    .venv/bin/uv pip install -q --python "$VPY" ${links[@]+"${links[@]}"} "$@" && return 0
    echo "setup: uv failed; pip installs instead" >&2
  fi
  "$VPY" -m pip install -q --no-compile --disable-pip-version-check "$@"
}
if ! "$VPY" -c "import torch" 2>/dev/null; then
  echo "setup: installing ${DDILOCO_TORCH:-torch==2.13.0}" >&2
  if [ -n "${DDILOCO_TORCH:-}" ]; then
    # shellcheck disable=SC2086  # DDILOCO_TORCH may carry pip options (an --index-url of a CUDA build)
    "$VPY" -m pip install -q --no-compile --disable-pip-version-check $DDILOCO_TORCH
  else
    install torch==2.13.0
  fi
fi
# The editable install is done once per pyproject.toml: its hash is stamped into .venv and a second run skips
# pip (delete .venv/.ddiloco-installed to install again)
STAMP=.venv/.ddiloco-installed
WANT=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$WANT" ]; then
  echo "setup: installing ddiloco (editable) with test tools and the [hf], [remote] and [plot] extras" >&2
  # torch is already in .venv at this point, and transformers does not require it, so pip keeps that build.
  install -e ".[dev,hf,remote,plot]"
  "$VPY" -c "import torch, transformers, tokenizers, pyarrow, libp2p, matplotlib" # fail here, not in the tests, if one is missing
  echo "$WANT" > "$STAMP"
fi
