"""What the database tests read back from a table, shared by test_database*.py."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from typing import Any

import sqlalchemy as sa

from kafkatx.testing import wait_for


def table_rows(engine: sa.Engine, table: str) -> Counter[str]:
    """How many rows each key has: a duplicate shows as a count above 1, a lost row as a missing key."""
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(sa.text(f"SELECT k FROM {table}")))


def restart_until_caught_up(args: list[str], kafka: Any, group: str, src: str, timeout: float) -> str:
    """Run the crashed app's command again until its group has committed all of ``src``; stop it with
    SIGTERM and return what it printed (the restart's own account of what it found)."""
    process = subprocess.Popen(args, env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: kafka.caught_up(group, src), timeout, message="the restarted app committed everything")
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    return output
