"""What a transaction unit does differently with ``database=``: finish work stored before a crash, find the
record behind a failed database commit, wait out an outage.

The unit (:mod:`kafkatx.listener.unit`) calls these from ``transact``; the
ordering argument they rely on is in docs/DATABASE.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from kafkatx._offsets import TP, first_offsets
from kafkatx.database.session import DatabaseUnavailableError
from kafkatx.errors import InvalidConfigurationError

if TYPE_CHECKING:
    from kafkatx.listener.unit import TransactionUnit

__all__ = ["isolate", "redeliver_stored", "wait_for_database"]

log = logging.getLogger("kafkatx.container")


def redeliver_stored(unit: TransactionUnit, stored: Mapping[TP, tuple[int, int]]) -> None:
    """Records whose database work committed but whose Kafka transaction did not (a crash between the two).

    The handler is not called again: the records it produced are read back
    from the outbox and produced, and the offsets up to the stored
    position committed. Partitions of the unit with nothing stored are
    fetched again.
    """
    database = unit._c.database
    assert database is not None
    producer = unit._producer
    recorder, producer.recorder = producer.recorder, None  # already in the outbox: not recorded twice
    replay: dict[TP, int] = {}
    try:
        for tp, (start, position) in stored.items():
            _check_position(unit, tp, position)
            known = unit._c.committed_offset(tp)
            if known is not None and known >= position:
                continue  # a stale fetch of records this owner has already committed in Kafka too
            if known is not None and known > start:
                start = known  # (Kafka commits at unit boundaries, so the outbox is keyed from there)
            outputs = database.stored_outputs(tp, start, position)
            log.warning(
                "listener %s: %s[%d] %d..%d already committed in the database but not in Kafka (a crash "
                "between the two commits?): producing its %d stored record(s) instead of running the handler",
                unit.listener,
                tp[0],
                tp[1],
                start,
                position - 1,
                len(outputs),
            )
            for out in outputs:
                unit.produce(out)
            replay[tp] = position
    finally:
        producer.recorder = recorder
    if replay:
        unit.send_offsets(replay)
    unit.commit()
    for tp, offset in first_offsets(unit.messages).items():
        if tp in stored:
            known = unit._c.committed_offset(tp)
            unit._c.seek(tp, max(stored[tp][1], known if known is not None else -1))
        else:
            unit._c.seek(tp, offset)


def _check_position(unit: TransactionUnit, tp: TP, position: int) -> None:
    """A stored position past the end of the partition was not written for this log: refuse it."""
    consumer = unit._c.consumer
    marks = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True) if consumer is not None else None
    if marks and marks[1] >= 0 and position > marks[1]:
        raise InvalidConfigurationError(
            f"listener {unit.listener!r}: the database says {tp[0]}[{tp[1]}] is done up to offset {position} "
            f"(table kafkatx_offsets, group {unit.group_id!r}), but the partition ends at {marks[1]}: the "
            "database was written for another Kafka cluster, or the topic was deleted and created again. "
            "kafkatx does not skip records on its word: delete the group's rows from kafkatx_offsets and "
            "kafkatx_outbox, or use the database that goes with this cluster"
        )


def isolate(unit: TransactionUnit, exc: BaseException, records: int) -> None:
    """The database commit of several records failed (a deferred constraint): handle them one per transaction.

    Nothing was committed on either side. The crash guard's careful mode
    runs each record of the unit in a transaction of its own, so the next
    commit that fails is one record's, and the failure policy decides about
    that record alone; its batch-mates commit.
    """
    unit.abort(records, f"database commit failed: {type(exc).__name__}")
    first, until = first_offsets(unit.messages), unit.next_offsets()
    log.warning(
        "listener %s: the database commit of a unit of %d records failed (%s: %s), which does not say which "
        "record caused it: handling %s one record per transaction to find it",
        unit.listener,
        len(unit.messages),
        type(exc).__name__,
        str(exc).strip().splitlines()[0] if str(exc).strip() else "",
        ", ".join(f"{t}[{p}] {first[(t, p)]}..{until[(t, p)] - 1}" for t, p in sorted(first)),
    )
    unit._c.guard.isolate(until)
    unit.rewind()


def wait_for_database(unit: TransactionUnit, exc: DatabaseUnavailableError, records: int) -> None:
    """Nothing committed on either side: fetch the unit again after a back-off (not a record's failure)."""
    database = unit._c.database
    assert database is not None
    unit.abort(records, str(exc))
    unit.rewind()
    database.unavailable += 1
    delay = min(30.0, 0.5 * 2 ** min(database.unavailable - 1, 6))
    log.warning("%s; nothing was committed, retrying in %.3gs", exc, delay)
    unit.wait(delay)
