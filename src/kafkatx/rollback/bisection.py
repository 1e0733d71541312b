"""Which records to handle next while looking for the one that killed the process (pure: no I/O).

A crash claim names a range of one partition's offsets, ``[start, end)``:
the records that were in flight when the process died. One of them is
suspected of killing it. The search handles the first half of the suspects
as one transaction, with a claim that names that half only; then:

- the half commits: its records are cleared, and the search goes on with the
  rest of the suspects, halving them again;
- the process dies again: the half's claim is found at the next start, and
  the half is the new range of suspects.

A range of one record that kills the process is that record's crash: it is
counted against it. So the record is found in about ``log2(end - start)``
restarts, and every record outside the claimed range is handled at full
speed. A crash that was not a record's fault (a force-kill, a node going
away) costs ``log2`` small transactions and nothing else: every half passes.

Ranges are in offsets. On a topic written by transactions, commit markers
take offsets too, so the usual claim (``max_batch_records`` offsets from the
committed one) can end a few records short of the batch that was in flight;
a record past it that kills the process again starts a search of its own
from the claim that run leaves, so it costs a restart, never a wrong count.

A database commit that fails for a unit of several records (a deferred
constraint) is isolated the other way, one record per transaction
(``halving=False``): that failure is an exception, seen in this process, not a
restart, so there is nothing to gain by halving.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Suspects", "after_commit", "claimed_suspects"]


@dataclass(frozen=True, slots=True)
class Suspects:
    """The records of one partition from the committed offset up to ``end`` (exclusive), one of them suspect."""

    end: int
    halving: bool = True

    def next_end(self, start: int) -> int:
        """Where the next transaction, starting at ``start``, ends (exclusive): the first half, or one record.

        Its claim names exactly this range, so a crash inside it narrows the
        search to it.
        """
        if not self.halving:
            return start + 1
        return start + max(1, (self.end - start) // 2)


def after_commit(suspects: Suspects, committed: int) -> Suspects | None:
    """The suspects left once everything before ``committed`` has committed (None: the search is over)."""
    return suspects if committed < suspects.end else None


def claimed_suspects(
    offset: int, inflight_until: int | None, careful_until: int | None, batch_records: int
) -> tuple[Suspects, bool]:
    """What an in-flight claim at ``offset`` that outlived its process names, and whether it blames one record.

    ``inflight_until`` is where a claim of less than a batch ends (written
    while searching). A claim without it is the usual one, of a batch: at
    most ``batch_records`` records from ``offset``; or, with ``careful_until``
    past ``offset``, an earlier version's, which was handling one record per
    transaction up to ``careful_until`` with the record at ``offset`` in
    flight (that goes on as it was, so that a rolling upgrade changes
    nothing).
    """
    if inflight_until is not None and inflight_until > offset:
        return Suspects(inflight_until), inflight_until == offset + 1
    if careful_until is not None and careful_until > offset:
        return Suspects(careful_until, halving=False), True
    return Suspects(offset + batch_records), batch_records == 1
