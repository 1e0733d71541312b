"""An output the broker refused is blamed on the input record that produced it, found by isolation.

The broker refuses a record for what it is (too large for the topic's
``max.message.bytes``, a null key on a compacted topic, see
:data:`~kafkatx.errors.classification.RECORD_REFUSAL_CODES`) in a delivery
report, which arrives when the transaction flushes or commits: long after
the handler that produced it returned. That report names the output
(topic, partition), not the input, and librdkafka fails a whole produce
request with the same code, so the innocent records batched with the
refused one are reported refused as well.

Two ways to find the input:

- remember, per output, the input that produced it, and match the reports.
  That is a closure or an entry per produced record on the hot path, and it
  would still blame the batch-mates the broker refused along with it;
- isolation: abort the transaction and run the unit's records again in
  transactions of one record each. The parts that pass commit as they pass;
  the one transaction still refused is one record's, and that record fails.

kafkatx does the second: it costs nothing until a refusal happens (a
deployment mismatch, rare), and it is always right. The isolation is the
crash guard's careful mode (:meth:`~kafkatx.listener.host.ClaimKeeper.isolate`,
also used for a database commit that fails in a unit of several records):
only the container holds the runner that can run records again, and a unit
knows its work as an opaque function. The careful mode runs the partitions'
records up to the end of the refused unit one per transaction
(:class:`~kafkatx.rollback.bisection.Suspects` with ``halving=False``):
halving, as for a crash, would find the record in fewer transactions, but
this failure is seen in this process, so narrowing a range after a failed
half needs the guard to shrink a search it can only widen today.

A unit of one record whose transaction is refused fails that record: a
:class:`~kafkatx.listener.host.HandlerFailure` carrying the
:class:`~kafkatx.errors.OutputRefusedError`, raised from ``transact`` after
the abort, which the record runner hands to the after-rollback path like a
handler's exception. The listener's failure policy decides (not retryable
by default: straight to the recoverer, the dead letter naming the broker's
error).

A listener without the careful mode (a Spark or batch listener, or
``count_crashes=False``) cannot run records one at a time: a refusal in a
unit of several records stops the container, the error saying so.
"""

from __future__ import annotations

import logging
from typing import Protocol

from kafkatx.client.offsets import first_offsets
from kafkatx.errors import InvalidConfigurationError, OutputRefusedError
from kafkatx.listener.host import ClaimKeeper, HandlerFailure, UnitBooks, UnitPositions, UnitRecords, UnitTransaction

__all__ = ["RefusedUnit", "blame_refused_output"]

log = logging.getLogger("kafkatx.container")


class RefusedUnit(UnitRecords, UnitBooks, UnitTransaction, UnitPositions, Protocol):
    """What blaming a refused output uses of its unit: its records, the abort, the rewind, the listener's name."""


def blame_refused_output(
    unit: RefusedUnit, guard: ClaimKeeper, exc: OutputRefusedError, records: int
) -> HandlerFailure | None:
    """React to ``exc`` refusing an output of ``unit``'s open transaction (``records`` records in it).

    Returns the failure to raise for a unit of one record; None when the
    records are to be run one per transaction (or the abort failed, and the
    unit was rewound). Raises InvalidConfigurationError (the container stops) when the records cannot be isolated.
    """
    msgs = unit.messages
    if len(msgs) > 1 and not guard.enabled:
        unit.abort(records, f"output refused: {exc.code_name}")
        raise InvalidConfigurationError(
            f"{exc.message}. Listener {unit.listener!r} cannot tell which of the {len(msgs)} records of the "
            "transaction produced it: it runs records one per transaction only with count_crashes=True, on a "
            "record listener. The container stopped; fix the topic or the handler's output and restart",
            error=exc.error,
            operation=exc.operation,
        ) from exc
    if not unit.abort(records, f"output refused: {exc.code_name}"):
        return None
    if len(msgs) == 1:
        record = unit.records(msgs)[0]
        log.warning(
            "listener %s: the broker refused an output of %s: %s", unit.listener, record.coordinates, exc.message
        )
        return HandlerFailure(0, exc, record)
    first, until = first_offsets(msgs), unit.next_offsets()
    log.warning(
        "listener %s: the broker refused an output of a transaction of %d records (%s): handling %s one record "
        "per transaction to find the record that produced it",
        unit.listener,
        len(msgs),
        exc.code_name,
        ", ".join(f"{t}[{p}] {first[(t, p)]}..{until[(t, p)] - 1}" for t, p in sorted(first)),
    )
    guard.isolate(until)
    unit.rewind()
    return None
