"""Progress of long work (train-local, sim, tokenising a corpus) on stderr: a rich progress bar in a terminal, a plain line
per 10% otherwise (logs and pipes get ten lines, not a stream of carriage returns)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn


class Bar:
    """``bar(frac, detail)`` reports progress in [0, 1]; ``close()`` ends the bar (idempotent)."""

    def __init__(self, label: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.label, self.enabled = label, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.monotonic()
        self._decile = -1
        self._rich: Progress | None = None
        self._task = None

    def __call__(self, frac: float, detail: str = "") -> None:
        if not self.enabled:
            return
        frac = min(1.0, max(0.0, frac))
        if self.tty:
            if self._rich is None:
                self._rich = Progress(
                    TextColumn(f"{self.label:<12}"),
                    BarColumn(),
                    TaskProgressColumn(),
                    TextColumn("{task.fields[detail]}"),
                    TimeElapsedColumn(),
                    console=Console(file=self.stream),
                )
                self._task = self._rich.add_task(self.label, total=1.0, detail=detail)
                self._rich.start()
            self._rich.update(self._task, completed=frac, detail=detail)
            return
        decile = int(frac * 10)
        if decile == self._decile:
            return
        self._decile = decile
        line = f"{self.label:<12} {frac * 100:5.1f}%  {detail}  {time.monotonic() - self.t0:5.1f}s"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None
