"""Where a record runner's transaction ended before its last record, on a failure, and what comes after it."""

from __future__ import annotations

from kafkatx.listener.failure.failed_record import Hold
from kafkatx.listener.host import HandlerFailure

__all__ = ["Cut"]


class Cut:
    """Where a transaction ended before its last record, on a failure, and what comes after it.

    ``index``: the first record not committed (with a ``hold``, that record's own offset is committed, carrying
    its count). ``hold``: its partition waits; ``handover``: a custom after-rollback processor decides about it;
    neither: the records from ``index`` are handled next, from memory.
    """

    __slots__ = ("index", "hold", "handover")

    def __init__(self, hold: Hold | None = None, handover: HandlerFailure | None = None) -> None:
        self.index = 0
        self.hold, self.handover = hold, handover

    @classmethod
    def after(cls, hold: Hold | None) -> Cut | None:
        """A cut holding ``hold``'s record, or None: the record was settled in the transaction, which goes on."""
        return None if hold is None else cls(hold)
