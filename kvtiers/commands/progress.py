"""Progress of long commands (bench, simulate, conformance, ``fs gc``).

On a terminal: one bar on stderr, redrawn in place, with the current step's note. Not on a
terminal (a log, CI, a pipe): one plain line per step, so logs stay greppable. Quiet (for
``--json``, or when the caller asks): nothing at all, so stdout and stderr carry only the
result.

    with Progress(total=6, label="bench fs") as bar:
        for step in steps:
            ...
            bar.advance(note="store 4 MiB: 2.1 GB/s")
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from ..engine.closing import Closing

BAR_WIDTH = 24


class Progress(Closing):
    """A progress reporter: ``advance`` after each step, ``note`` for a line between steps.

    ``total``: the number of steps (0 or None: unknown, no bar, only a counter).
    ``quiet``: print nothing. ``tty``: force (True) or suppress (False) the terminal bar;
    by default it follows ``file.isatty()``. :func:`bar_only` makes one that shows a bar on
    a terminal and nothing elsewhere, for commands whose output is already one line per step.
    """

    def __init__(self, total: int | None, label: str, *, quiet: bool = False, file: TextIO | None = None,
                 tty: bool | None = None) -> None:
        self.total = total or 0
        self.label = label
        self.quiet = quiet
        self.file = file if file is not None else sys.stderr
        if tty is None:
            isatty = getattr(self.file, "isatty", None)
            tty = bool(isatty and isatty())
        self.tty = tty
        self.done = 0
        self.started = time.monotonic()
        self._drawn = False

    def advance(self, n: int = 1, note: str = "") -> None:
        """Count ``n`` more steps done; ``note`` says what the last one was or found."""
        self.done += n
        if self.quiet:
            return
        if self.tty:
            self._draw(note)
        else:
            of = f"/{self.total}" if self.total else ""
            self._line(f"{self.label} {self.done}{of}" + (f": {note}" if note else ""))

    def note(self, text: str) -> None:
        """A line of its own (above the bar on a terminal)."""
        if self.quiet:
            return
        if self.tty and self._drawn:
            self.file.write("\r\x1b[2K")
        self._line(f"{self.label}: {text}")
        if self.tty and self._drawn:
            self._draw("")

    def clear(self) -> None:
        """Erase the bar (terminal only) so the caller can print lines of its own, on stdout
        or stderr; the next :meth:`advance` draws it again below them."""
        if self.tty and self._drawn and not self.quiet:
            self.file.write("\r\x1b[2K")
            self.file.flush()
            self._drawn = False

    def close(self) -> None:
        """End the bar's line (terminal only)."""
        if self.tty and self._drawn and not self.quiet:
            self.file.write("\n")
            self.file.flush()
            self._drawn = False

    def _draw(self, note: str) -> None:
        elapsed = time.monotonic() - self.started
        if self.total:
            frac = min(1.0, self.done / self.total)
            fill = int(frac * BAR_WIDTH)
            bar = f"[{'#' * fill}{'-' * (BAR_WIDTH - fill)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done}"
        text = f"{self.label} {bar} {elapsed:5.0f}s" + (f"  {note}" if note else "")
        self.file.write("\r\x1b[2K" + text[:160])
        self.file.flush()
        self._drawn = True

    def _line(self, text: str) -> None:
        self.file.write(text + "\n")
        self.file.flush()


def bar_only(total: int | None, label: str, *, quiet: bool = False, file: TextIO | None = None) -> Progress:
    """A :class:`Progress` that draws a bar on a terminal and prints nothing otherwise."""
    p = Progress(total, label, quiet=quiet, file=file)
    if not p.tty:
        p.quiet = True
    return p
