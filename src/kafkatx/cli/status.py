"""The live status line of ``kafkatx run`` on a terminal.

One line on stderr, redrawn about once a second::

    kafkatx orders | 1,204 rec/s | processed 88,112 | failed 3 | dlq 1 | aborted 3 | lag 120

It counts from the App's events itself (prometheus_client is not needed) and
reads lag from the librdkafka statistics shared with :mod:`kafkatx.metrics`.
Log lines written to the same terminal clear the status line first, so the
two never end up on one line. When stderr is not a terminal it does nothing.
"""

from __future__ import annotations

import collections
import logging
import shutil
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, TextIO

from kafkatx.events import HandlerFailed, RecordRecovered, TransactionAborted, TransactionCommitted

if TYPE_CHECKING:
    from kafkatx.app import App
    from kafkatx.metrics.lag import LagTracker

__all__ = ["StatusLine"]

log = logging.getLogger("kafkatx.status")

_CLEAR = "\r\x1b[K"  # carriage return, erase to end of line
_RATE_WINDOW_S = 5.0
_STATS_INTERVAL_MS = 1_000


class StatusLine:
    """A one-line live summary of an App on a terminal; ``start()`` returns self, ``stop()`` clears it."""

    def __init__(self, app: App, *, stream: TextIO | None = None, interval: float = 1.0) -> None:
        self.app = app
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.processed = 0
        self.failed = 0
        self.recovered = 0
        self.aborted = 0
        self._lock = threading.Lock()
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._shown = False
        self._active = False
        self._lag: LagTracker | None = None
        self._wrapped: list[tuple[logging.StreamHandler[Any], Any]] = []

    @property
    def enabled(self) -> bool:
        """Only a terminal gets a status line: in a pipe or a log file, ``\\r`` redraws are noise."""
        try:
            return bool(self.stream.isatty())
        except (AttributeError, ValueError):  # no isatty(), or a closed stream
            return False

    def start(self) -> StatusLine:
        if self._thread is not None or not self.enabled:
            return self
        self._active = True
        on = self.app.events.subscribe
        on(TransactionCommitted, self._on_committed)
        on(TransactionAborted, self._on_aborted)
        on(RecordRecovered, self._on_recovered)
        on(HandlerFailed, self._on_failed)
        try:
            from kafkatx.metrics.lag import shared_lag_tracker

            self._lag = shared_lag_tracker(self.app, _STATS_INTERVAL_MS)
        except Exception:  # lag is a nice-to-have; never keep the App from running
            log.debug("status line without consumer lag", exc_info=True)
        self._redirect_logging()
        self._thread = threading.Thread(target=self._run, name="kafkatx-status", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop redrawing and erase the line. Idempotent."""
        thread, self._thread = self._thread, None
        self._active = False  # the event bus has no unsubscribe: our callbacks go quiet instead
        if thread is None:
            return
        self._stop.set()
        thread.join(2)
        with self._lock:
            self._clear_locked()
        self._restore_logging()

    # -- counting (container threads; once per transaction or failure) -----------
    def _on_committed(self, event: TransactionCommitted) -> None:
        if self._active:
            with self._lock:
                self.processed += event.records

    def _on_aborted(self, event: TransactionAborted) -> None:
        if self._active:
            with self._lock:
                self.aborted += 1

    def _on_failed(self, event: HandlerFailed) -> None:
        if self._active:
            with self._lock:
                self.failed += 1

    def _on_recovered(self, event: RecordRecovered) -> None:
        if self._active:
            with self._lock:
                self.recovered += 1

    # -- drawing -------------------------------------------------------------------
    def render(self, now: float | None = None) -> str:
        """The status text (without terminal control characters)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            processed = self.processed
            samples = self._samples
            samples.append((now, processed))
            while len(samples) > 2 and samples[0][0] < now - _RATE_WINDOW_S:
                samples.popleft()
            t0, n0 = samples[0]
            rate = (processed - n0) / (now - t0) if now > t0 else 0.0
            failed, recovered, aborted = self.failed, self.recovered, self.aborted
        lag = self._lag.total() if self._lag is not None else None
        parts = [
            f"kafkatx {self.app.name}",
            f"{rate:,.0f} rec/s",
            f"processed {processed:,}",
            f"failed {failed:,}",
            f"dlq {recovered:,}",
            f"aborted {aborted:,}",
            f"lag {'?' if lag is None else format(lag, ',')}",
        ]
        return " | ".join(parts)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                text = self.render()
                width = shutil.get_terminal_size((100, 20)).columns
                with self._lock:
                    self.stream.write(_CLEAR + text[: max(width - 1, 10)])
                    self.stream.flush()
                    self._shown = True
            except Exception:  # a closed terminal must not kill the process
                log.debug("status line update failed", exc_info=True)
                return

    def _clear_locked(self) -> None:
        if self._shown:
            try:
                self.stream.write(_CLEAR)
                self.stream.flush()
            except Exception:
                pass
            self._shown = False

    # -- sharing the terminal with logging ---------------------------------------------
    def write_over(self, stream: TextIO, text: str) -> int:
        """Erase the status line, then write ``text`` to ``stream`` (the line is redrawn next tick)."""
        with self._lock:
            self._clear_locked()
            return stream.write(text)

    def _redirect_logging(self) -> None:
        """Make log handlers on our stream erase the status line before each record."""
        for handler in _all_handlers():
            if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is self.stream:
                self._wrapped.append((handler, handler.stream))
                handler.setStream(_ClearingStream(self, self.stream))  # type: ignore[arg-type]

    def _restore_logging(self) -> None:
        wrapped, self._wrapped = self._wrapped, []
        for handler, stream in wrapped:
            if isinstance(handler.stream, _ClearingStream):
                handler.setStream(stream)


class _ClearingStream:
    """A log handler's stream that erases the status line before writing (it is redrawn next tick)."""

    def __init__(self, status: StatusLine, stream: TextIO) -> None:
        self._status = status
        self._stream = stream

    def write(self, text: str) -> int:
        return self._status.write_over(self._stream, text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def _all_handlers() -> list[logging.Handler]:
    loggers: list[logging.Logger] = [logging.getLogger()]
    loggers += [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    return [h for lg in loggers for h in lg.handlers]
