"""Recoverers: what happens to a record whose attempts are used up.

A recoverer is any callable ``(record, exception) -> None``. It runs inside
the after-rollback transaction, so whatever it sends with
:func:`kafkatx.send` commits atomically with the failed record's offset. If
it raises, nothing is committed and the record is kept for another try.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kafkatx.context import RecoveryContext, current_recovery
from kafkatx.record import Record

__all__ = ["Recoverer", "LoggingRecoverer", "CompositeRecoverer", "as_recoverer", "RecoveryContext", "current_recovery"]

log = logging.getLogger("kafkatx.recoverers")


class Recoverer:
    """Base class for recoverers; subclasses implement :meth:`recover`."""

    def recover(self, record: Record, exception: BaseException) -> None:
        """Handle ``record`` whose attempts ran out; raise to keep it (the recovery is retried)."""
        raise NotImplementedError

    def __call__(self, record: Record, exception: BaseException) -> None:
        self.recover(record, exception)

    @property
    def name(self) -> str:
        """The name used in logs and events."""
        return type(self).__name__

    def setup(self, context: Any) -> None:
        """Called once at container start with the listener's setup context
        (to create topics, validate settings). The default does nothing."""


class LoggingRecoverer(Recoverer):
    """Logs the record at ERROR and skips it: Spring's default recoverer.

    Its offset is committed, so the record is not delivered again.
    """

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or log

    def recover(self, record: Record, exception: BaseException) -> None:
        """Log the record at ERROR; it is skipped (its offset commits)."""
        self.logger.error(
            "giving up on %s after %d attempt(s): %s: %s; record skipped (configure dlq= to keep it)",
            record.coordinates,
            record.attempt,
            type(exception).__name__,
            exception,
            extra={
                "topic": record.topic,
                "partition": record.partition,
                "offset": record.offset,
                "attempt": record.attempt,
            },
        )


class _CallableRecoverer(Recoverer):
    def __init__(self, fn: Callable[[Record, BaseException], Any]) -> None:
        self.fn = fn

    def recover(self, record: Record, exception: BaseException) -> None:
        self.fn(record, exception)

    @property
    def name(self) -> str:
        return getattr(self.fn, "__qualname__", repr(self.fn))


class CompositeRecoverer(Recoverer):
    """Runs several recoverers in order, all inside the same transaction.

    If one raises, the later ones do not run and the whole recovery is rolled back.
    """

    def __init__(self, *recoverers: Callable[[Record, BaseException], Any]) -> None:
        if not recoverers:
            raise ValueError("CompositeRecoverer needs at least one recoverer")
        self.recoverers = [as_recoverer(r) for r in recoverers]

    def recover(self, record: Record, exception: BaseException) -> None:
        """Run each recoverer in order, in the same transaction."""
        for r in self.recoverers:
            r.recover(record, exception)

    def setup(self, context: Any) -> None:
        for r in self.recoverers:
            r.setup(context)

    @property
    def name(self) -> str:
        """The recoverers' names, joined with "+"."""
        return "+".join(r.name for r in self.recoverers)


def as_recoverer(obj: Callable[[Record, BaseException], Any] | Recoverer) -> Recoverer:
    if isinstance(obj, Recoverer):
        return obj
    if callable(obj):
        return _CallableRecoverer(obj)
    raise TypeError(f"a recoverer must be a Recoverer or a callable (record, exception) -> None, got {obj!r}")
