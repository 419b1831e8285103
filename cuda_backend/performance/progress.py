"""A progress bar on stderr: on a terminal tqdm when it is installed, else a small built-in
redrawn line; in a log (not a terminal) a plain line every 10% of the cases."""
from __future__ import annotations

import sys
from typing import Any, Optional, TextIO


class Progress:
    """`step(label)` before each case, `close()` at the end."""

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None) -> None:
        self.total, self.done = total, 0
        self.stream = stream or sys.stderr
        self.enabled = enabled and total > 0
        self._tqdm: Any = None
        self._last_decile = -1
        if not self.enabled or not self.tty:  # in a log, tqdm's redraws are noise
            return
        try:
            from tqdm import tqdm
        except ImportError:
            return
        self._tqdm = tqdm(total=total, file=self.stream, unit="case", leave=False,
                          dynamic_ncols=True)

    @property
    def tty(self) -> bool:
        return bool(getattr(self.stream, "isatty", lambda: False)())

    def step(self, label: str) -> None:
        """Show that case `label` is starting (counts the previous one as done)."""
        if not self.enabled:
            return
        if self._tqdm is not None:
            if self.done:
                self._tqdm.update(1)
            self._tqdm.set_description_str(label[:60])
        elif self.tty:
            filled = int(30 * self.done / self.total)
            line = f"\r[{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label}"
            self.stream.write(line[:120].ljust(120))
            self.stream.flush()
        else:
            decile = 10 * self.done // self.total
            if decile != self._last_decile:
                self._last_decile = decile
                self.stream.write(f"report: {self.done}/{self.total} cases, now {label}\n")
                self.stream.flush()
        self.done += 1

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.update(1)
            self._tqdm.close()
        elif self.tty:
            self.stream.write("\r" + " " * 120 + "\r")
            self.stream.flush()
        self.enabled = False
