"""What the database tests read back from a table, shared by test_database*.py."""

from __future__ import annotations

from collections import Counter

import sqlalchemy as sa


def table_rows(engine: sa.Engine, table: str) -> Counter[str]:
    """How many rows each key has: a duplicate shows as a count above 1, a lost row as a missing key."""
    with engine.connect() as conn:
        return Counter(r[0] for r in conn.execute(sa.text(f"SELECT k FROM {table}")))
