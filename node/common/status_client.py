"""The client of a node's HTTP status endpoint: ``GET /status`` and ``POST /control`` (``ddiloco status``,
``ddiloco up``, the chaos harness). The server side is ``node.swarm.status``."""

from __future__ import annotations

import json
import os
import secrets
import urllib.error
import urllib.request
from pathlib import Path

from protocol.errors import DDiLoCoError

ACTIONS = ("pause", "resume", "stop", "evaluate", "block", "forget")
TOKEN_FILE = "control.token"  # in a node's state folder, mode 0600: what POST /control must carry


def write_control_token(state_dir: str | Path) -> str:
    """A fresh control token for a node starting on ``state_dir``, written readable by its user only."""
    token = secrets.token_hex(32)
    path = Path(state_dir) / TOKEN_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    os.chmod(tmp, 0o600)  # an existing file keeps its mode through O_CREAT
    os.replace(tmp, path)
    return token


def read_control_token(state_dir: str | Path) -> str:
    """The control token of the node running on ``state_dir`` (StatusError if there is none to read)."""
    path = Path(state_dir) / TOKEN_FILE
    try:
        return path.read_text().strip()
    except OSError as e:
        raise StatusError(f"cannot read the node's control token {path}: {e.strerror}") from e


class StatusError(DDiLoCoError):
    """The status endpoint could not be read; the message says which URL and what to check."""


def fetch_status(url: str, timeout_s: float = 5.0) -> dict:
    return _request(url.rstrip("/") + "/status", None, timeout_s)


def send_control(url: str, action: str, timeout_s: float = 5.0, token: str | None = None, **extra) -> dict:
    """POST /control: ``token`` is the node's control token (``read_control_token``); without it the node
    answers 403 and changes nothing."""
    body = json.dumps({"action": action, **extra}).encode()
    return _request(url.rstrip("/") + "/control", body, timeout_s, token)


def _request(url: str, data: bytes | None, timeout_s: float, token: str | None = None) -> dict:
    req = urllib.request.Request(url, data=data)
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:  # noqa: S310 - our own URL
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        try:
            msg = json.loads(e.read()).get("error", "")
        except ValueError:
            msg = ""
        raise StatusError(f"{url}: HTTP {e.code} {msg}") from e
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise StatusError(
            f"{url}: no answer ({getattr(e, 'reason', e)}); is the node running, and is this its status "
            "address (see STATE_DIR/ready.json)?"
        ) from e
