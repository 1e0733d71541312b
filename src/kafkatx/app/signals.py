"""SIGINT/SIGTERM as stop requests: one signal delivered twice at once is one request, not a demand to force the exit.

GNU ``timeout`` signals the process and then its process group; systemd's
``KillMode=control-group`` signals every process of the service, so a
``--workers`` worker gets that signal and the one its supervisor forwards;
a terminal's Ctrl-C reaches the supervisor and its workers alike. Counting
each delivery as a request would turn every such stop into a forced exit.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["SAME_REQUEST_WINDOW_S", "StopRequests", "install_exit_handlers"]

log = logging.getLogger("kafkatx.app")

#: Signals this soon after the first one of a request repeat it (a forwarded copy comes within milliseconds;
#: a person sending a second signal on purpose takes longer).
SAME_REQUEST_WINDOW_S = 1.0


class StopRequests:
    """Counts stop requests, folding the signals that arrive within ``window`` seconds of a request into it."""

    def __init__(self, window: float = SAME_REQUEST_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window = window
        self._clock = clock
        #: Requests so far: 1 asks for a graceful stop, 2 or more for a forced exit.
        self.count = 0
        #: The signal of the first request (the exit code of a forced exit is 128 + it), 0 before any.
        self.first_signal = 0
        self._request_started: float | None = None

    def receive(self, signum: int) -> int | None:
        """The number of the request ``signum`` makes, or None when it repeats the current one."""
        now = self._clock()
        if self._request_started is not None and now - self._request_started < self.window:
            return None
        self._request_started = now
        self.count += 1
        self.first_signal = self.first_signal or signum
        return self.count


def install_exit_handlers(started: Callable[[], bool]) -> None:
    """SIGINT/SIGTERM handlers for a command that runs an App (or a supervisor) until it stops, and then exits.

    ``App.run()`` puts back the handlers it found when it returns, so the copy
    of the signal that stopped it (sent to the group, or forwarded by a
    supervisor) would meet the default handler and kill the process: install
    these first. Before ``started()`` a signal exits (128 + its number) as the
    default handler would; after it the process is on its way out, so a first
    request is ignored and only a later one forces the exit.
    """
    if threading.current_thread() is not threading.main_thread():
        return  # Python takes signal handlers from the main thread only, and runs them there
    requests = StopRequests()

    def on_signal(signum: int, _frame: object) -> None:
        if not started():
            raise SystemExit(128 + signum)
        request = requests.receive(signum)
        if request == 1:
            log.info("%s received: already stopping", signal.Signals(signum).name)
        elif request is not None:
            log.warning("second signal: forcing exit")
            raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
