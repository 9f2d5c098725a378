"""A progress line for the slow steps (export of a catalog, ``optimize``, capture), without a dependency.

Exporting a released-size catalog takes about a minute, ``optimize`` tens of seconds: long enough
that a silent process looks hung. :class:`Progress` draws one ``\\r``-updated line on stderr, and only
when it helps: the work has run longer than ``delay`` seconds (quick runs, tests, stay silent) and
stderr is a terminal, or ``CADENCE_FX_PROGRESS=1`` forces it (``0`` turns it off). When no line is
drawn (a log file, a CI job), a step that took longer than ``delay`` is reported once through
``logging`` (logger ``cadence_fx.progress``, INFO) when it finishes.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress", "progress_enabled"]

log = logging.getLogger("cadence_fx.progress")

#: seconds a step runs before its line appears (or before its end is worth a log record)
DEFAULT_DELAY_S = 3.0


def progress_enabled(stream: TextIO | None = None) -> bool:
    """Whether progress lines are drawn: ``CADENCE_FX_PROGRESS`` (``1``/``0``) if set, else whether
    ``stream`` (stderr) is a terminal."""
    env = os.environ.get("CADENCE_FX_PROGRESS", "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


class Progress:
    """``total`` units of work under ``label``; :meth:`advance` after each, :meth:`close` (or the
    ``with`` block's end) when done.

    Drawing is throttled to ten redraws a second and starts only after ``delay`` seconds, so the
    per-unit cost is a clock read. The line goes to ``stream`` (stderr); nothing is drawn when
    :func:`progress_enabled` says no, and the finished step is logged instead when it was slow.
    """

    def __init__(self, label: str, total: int, *, delay: float = DEFAULT_DELAY_S, enabled: bool | None = None,
                 stream: TextIO | None = None) -> None:
        self.label = label
        self.total = max(int(total), 0)
        self.done = 0
        self.note = ""
        self.delay = delay
        self._stream = sys.stderr if stream is None else stream
        self._draw = progress_enabled(self._stream) if enabled is None else enabled
        self._t0 = time.perf_counter()
        self._last_draw = 0.0
        self._drawn = False
        self._closed = False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def advance(self, n: int = 1, note: str = "") -> None:
        """``n`` more units done; ``note`` says what the next one is (shown after the count)."""
        self.done = min(self.done + n, self.total) if self.total else self.done + n
        self.note = note
        self._maybe_draw()

    def _maybe_draw(self, *, final: bool = False) -> None:
        if not self._draw:
            return
        now = time.perf_counter()
        if now - self._t0 < self.delay and not self._drawn:
            return
        if not final and now - self._last_draw < 0.1:
            return
        self._last_draw = now
        width = 24
        fill = int(width * self.done / self.total) if self.total else width
        note = f"  {self.note}" if self.note and not final else ""
        line = f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {now - self._t0:.1f} s{note}"
        try:
            self._stream.write(line.ljust(getattr(self, "_width", 0)))
            self._width = len(line)
            if final:
                self._stream.write("\n")
            self._stream.flush()
        except (OSError, ValueError):  # a closed stream must not break the work it reports on
            self._draw = False
            return
        self._drawn = True

    def close(self) -> None:
        """Finish the line (when one was drawn) or log the step once when it was slow."""
        if self._closed:
            return
        self._closed = True
        if self._drawn:
            self._maybe_draw(final=True)
        elif self.elapsed >= self.delay:
            log.info("%s: %d/%d in %.1f s", self.label, self.done, self.total, self.elapsed)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
