"""Where ddiloco keeps what it can make again (generated text, tokenised corpora): ``$DDILOCO_CACHE``, else
``$XDG_CACHE_HOME/ddiloco``, else ``~/.cache/ddiloco``."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    env = os.environ.get("DDILOCO_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "ddiloco"
