"""The tables the database tests write to and what they read back from them, shared by test_database*.py."""

from __future__ import annotations

import os
import signal
import subprocess
from collections import Counter
from typing import Any

import sqlalchemy as sa

from kafkatx.testing import unique_name, wait_for


def fresh_table(engine: sa.Engine, name: str, unique: bool = False) -> None:
    """Create the table ``name`` (k, v) anew, dropping what an earlier run left; ``unique`` makes k UNIQUE."""
    with engine.begin() as conn:
        conn.execute(sa.text(f"DROP TABLE IF EXISTS {name}"))
        constraint = " UNIQUE" if unique else ""
        conn.execute(sa.text(f"CREATE TABLE {name} (k VARCHAR(64){constraint}, v VARCHAR(64))"))


def new_table(engine: sa.Engine, unique: str = "") -> str:
    """Create a (k, v) table under a name of its own and return the name; ``unique`` is k's column constraint."""
    name = unique_name("t").replace("-", "_")
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE TABLE {name} (k VARCHAR(64) {unique}, v VARCHAR(64))"))
    return name


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
