"""The client of a node's HTTP status endpoint: ``GET /status`` and ``POST /control`` (``ddiloco status``,
``ddiloco up``, the chaos harness). The server side is ``node.swarm.status``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from protocol.errors import DDiLoCoError

ACTIONS = ("pause", "resume", "stop", "block")


class StatusError(DDiLoCoError):
    """The status endpoint could not be read; the message says which URL and what to check."""


def fetch_status(url: str, timeout_s: float = 5.0) -> dict:
    return _request(url.rstrip("/") + "/status", None, timeout_s)


def send_control(url: str, action: str, timeout_s: float = 5.0, **extra) -> dict:
    return _request(url.rstrip("/") + "/control", json.dumps({"action": action, **extra}).encode(), timeout_s)


def _request(url: str, data: bytes | None, timeout_s: float) -> dict:
    try:
        with urllib.request.urlopen(url, data=data, timeout=timeout_s) as resp:  # noqa: S310 - our own URL
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
