"""How many lines a kind of log message may write: a few per window, the rest counted and summed up in one line.

A listener whose records fail often (1% of 100,000 records/s, each retried
through a retry topic) would write a line per failure: a thousand lines a
second that say the same thing, and the formatting and writing of each on the
processing thread. The events (``HandlerFailed``, ``RecordRetryScheduled``)
and their metrics count every failure; the log shows the first ones of each
window as they are, and the rest at DEBUG, with one line saying how many
there were when the next window starts.

Pure: the clock is passed in; one budget per kind of message, one window per
listener (keyed by whatever names it: two Apps' listeners of the same name are
two listeners).
"""

from __future__ import annotations

from collections.abc import Hashable

__all__ = ["LogBudget"]


class LogBudget:
    """At most ``lines`` lines per ``window`` seconds, per listener; the others are counted."""

    __slots__ = ("lines", "window", "_windows")

    def __init__(self, lines: int = 10, window: float = 10.0) -> None:
        self.lines = lines
        self.window = window
        #: listener -> (when its window started, lines written in it, lines held back in it)
        self._windows: dict[Hashable, list[float]] = {}

    def take(self, listener: Hashable, now: float) -> tuple[bool, int, float]:
        """May a line about ``listener`` be written at ``now`` (monotonic seconds)? Also how many were held back in
        the window that ended before it (0 when none ended, or none were) and how long that window was: the
        caller says so, once."""
        window = self._windows.get(listener)
        if window is None:
            if len(self._windows) > 1024:  # listeners come and go in tests: keep the map small
                self._windows.clear()
            window = self._windows[listener] = [now, 0.0, 0.0]
        held, span = 0, 0.0
        if now - window[0] >= self.window:
            held, span = int(window[2]), now - window[0]
            window[0], window[1], window[2] = now, 0.0, 0.0
        if window[1] < self.lines:
            window[1] += 1
            return True, held, span
        window[2] += 1
        return False, held, span
