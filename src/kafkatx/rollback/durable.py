"""Attempt counts that travel with the committed offset.

When the after-rollback transaction keeps a failing record for another
attempt, it commits the record's own offset (nothing past it) with
offset-commit metadata saying how often it has failed. Whoever owns the
partition next (after a restart, a rebalance, in another process) reads it
with the committed offset and goes on counting, so ``max_attempts`` means the
same thing across restarts. Any later commit of that partition (the record
succeeded or was recovered) carries no metadata and so clears it.

The metadata is a short JSON object behind a ``kafkatx:`` prefix; foreign
or malformed metadata is ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["DurableCount", "encode", "decode"]

_PREFIX = "kafkatx:"


@dataclass(frozen=True, slots=True)
class DurableCount:
    """The failure count of the record at ``offset``, as committed by its last owner."""

    offset: int
    failures: int


def encode(offset: int, failures: int) -> str:
    return _PREFIX + json.dumps({"offset": offset, "failures": failures}, separators=(",", ":"))


def decode(metadata: str | None) -> DurableCount | None:
    if not metadata or not metadata.startswith(_PREFIX):
        return None
    try:
        data = json.loads(metadata[len(_PREFIX) :])
        offset, failures = data["offset"], data["failures"]
    except (ValueError, KeyError, TypeError):
        return None
    if not (isinstance(offset, int) and isinstance(failures, int)) or offset < 0 or failures < 0:
        return None
    return DurableCount(offset, failures)
