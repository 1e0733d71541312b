"""Reading a child process's output as it runs, shared by the tests that start `kafkatx run`."""

from __future__ import annotations

import re
import subprocess
import time


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
