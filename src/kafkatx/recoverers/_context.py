"""What a recoverer can see of the transaction it runs in."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RecoveryContext", "current_recovery", "bind_recovery"]


@dataclass(slots=True)
class RecoveryContext:
    """Set by the container around a recoverer call.

    ``partition_count(topic)`` answers from cluster metadata (None if the
    topic does not exist); ``flush()`` waits for the records sent so far and
    returns their delivery errors, so a recoverer can fail when its sends did.
    """

    listener: str
    group_id: str
    partition_count: Callable[[str], int | None]
    flush: Callable[[], list[str]]


class _State(threading.local):
    ctx: RecoveryContext | None = None


_state = _State()


def current_recovery() -> RecoveryContext | None:
    return _state.ctx


def bind_recovery(ctx: RecoveryContext | None) -> RecoveryContext | None:
    previous, _state.ctx = _state.ctx, ctx
    return previous
