"""Reading a child process's output as it runs, shared by the tests that start `kafkatx run`."""

from __future__ import annotations

import queue
import re
import subprocess
import threading
import time
from typing import IO


def read_until(
    proc: subprocess.Popen[str], pattern: str, timeout: float = 60, seen: list[str] | None = None
) -> re.Match[str]:
    """Read ``proc``'s lines until one matches ``pattern`` (appending each to ``seen``, for later checks).

    Fails with the last lines read when the pattern does not come within ``timeout`` or the process ends.
    """
    assert proc.stdout is not None
    seen = [] if seen is None else seen
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"{pattern!r} not printed; output:\n{''.join(seen[-30:])}")


class ChildOutput:
    """A child's output, read line by line by a thread of its own, so that a wait for a line keeps its deadline
    while the child prints nothing (a blocking ``readline()`` outlives it, up to pytest's timeout, and the
    failure then shows no output). Every line read is kept in ``lines``, for the test's checks and messages."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line)
        self._queue.put(None)

    def next_line(self, deadline: float) -> str | None:
        """The next line; None once ``deadline`` (``time.monotonic()``) has passed or the output has ended."""
        try:
            line = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return None
        if line is None:
            self._queue.put(None)  # the end stays the end for the next call
            return None
        self.lines.append(line)
        return line

    def rest(self, timeout: float) -> str:
        """What the child prints from here until it exits (within ``timeout``)."""
        self.proc.wait(timeout)
        self._thread.join(timeout)
        start = len(self.lines)
        while self.next_line(time.monotonic()) is not None:
            pass
        return "".join(self.lines[start:])

    def text(self) -> str:
        return "".join(self.lines)
