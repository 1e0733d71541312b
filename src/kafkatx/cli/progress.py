"""A worker's sign to its supervisor that it got somewhere: the modification time of a file.

The supervisor gives up on a worker that keeps crashing (a crash loop). A
worker that crashes on a poison record is not in a loop as long as each
run gets further: records committed, the record dead-lettered, or the search
for the record that killed it narrowed (:class:`~kafkatx.events.CrashSearchNarrowed`).
Such a crash is restarted without counting towards the limit. Finding the
record costs about ``log2(max_batch_records)`` crashes, then ``max_attempts``
crashes of the record alone, which do count.
"""

from __future__ import annotations

import os
import time
from typing import Any

from kafkatx.events import CrashSearchNarrowed, Event, RecordRecovered, TransactionCommitted

__all__ = ["ENV_PROGRESS_FILE", "ProgressFile", "report_progress"]

#: Set by the supervisor for each worker: the file whose mtime the worker moves when it makes progress.
ENV_PROGRESS_FILE = "KAFKATX_PROGRESS_FILE"


class ProgressFile:
    """Touches ``path`` on progress, at most once per ``min_interval`` seconds (the supervisor only asks
    whether it moved since the worker started)."""

    def __init__(self, path: str, min_interval: float = 1.0) -> None:
        self.path = path
        self.min_interval = min_interval
        self._last: float | None = None

    def on_event(self, event: Event) -> None:
        if isinstance(event, TransactionCommitted) and event.records == 0:
            return  # a claim marker: every start commits some, they say nothing about progress
        now = time.monotonic()
        if self._last is not None and now - self._last < self.min_interval:
            return
        self._last = now
        try:
            os.utime(self.path)
        except OSError:
            pass  # the supervisor went away or cleaned up: nothing to tell

    def reset(self) -> None:
        """Before a worker starts: no progress yet."""
        with open(self.path, "wb"):
            pass
        os.utime(self.path, (0, 0))

    def moved(self) -> bool:
        """Whether the worker touched the file since :meth:`reset`."""
        try:
            return os.stat(self.path).st_mtime > 0
        except OSError:
            return False


def report_progress(app: Any) -> None:
    """Under a supervisor, make ``app`` touch its progress file on commits, recoveries and crash-search steps."""
    path = os.environ.get(ENV_PROGRESS_FILE)
    if not path:
        return
    progress = ProgressFile(path)
    for event_type in (TransactionCommitted, RecordRecovered, CrashSearchNarrowed):
        app.on(event_type)(progress.on_event)
