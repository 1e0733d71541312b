"""What a transaction unit does differently with ``database=``: finish work stored before a crash, find the
record behind a failed database commit, report an outage.

A mixin of :class:`~kafkatx.listener.transaction.unit.TransactionUnit`: ``transact``
calls these steps on the unit itself. The ordering argument they rely on is
in docs/DATABASE.md.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP, first_offsets
from kafkatx.database.session import DatabaseUnavailableError
from kafkatx.errors import InvalidConfigurationError
from kafkatx.listener.transaction.positions import rewind
from kafkatx.record import to_record

if TYPE_CHECKING:
    from kafkatx.client.producer import TransactionalProducer
    from kafkatx.listener.host import TransactionHost
    from kafkatx.outputs import PendingOutput
    from kafkatx.record import ConsumedMessage

__all__ = ["DatabaseSteps"]

log = logging.getLogger("kafkatx.container")


class DatabaseSteps:
    """The ``database=`` steps of a transaction unit (the unit's own state, hence a mixin)."""

    __slots__ = ()

    # Provided by TransactionUnit.
    _c: TransactionHost
    _producer: TransactionalProducer
    messages: list[ConsumedMessage]
    listener: str
    group_id: str

    if TYPE_CHECKING:

        def produce(self, output: PendingOutput) -> None: ...
        def send_offsets(self, offsets: Mapping[TP, int], metadata: Mapping[TP, str] | None = None) -> None: ...
        def commit(self) -> None: ...
        def abort(self, records: int, reason: str) -> bool: ...
        def next_offsets(self, messages: Sequence[ConsumedMessage] | None = None) -> dict[TP, int]: ...
        def rewind(self, messages: Sequence[ConsumedMessage] | None = None) -> None: ...
        def wait(self, seconds: float) -> bool: ...

    def redeliver_stored(self, stored: Mapping[TP, tuple[int, int]]) -> None:
        """Records whose database work committed but whose Kafka transaction did not (a crash between the two).

        The handler is not called again: the records it produced are read back
        from the outbox and produced, and the offsets up to the stored
        position committed. Partitions of the unit with nothing stored are
        fetched again.
        """
        database = self._c.database
        assert database is not None
        producer = self._producer
        recorder, producer.recorder = producer.recorder, None  # already in the outbox: not recorded twice
        replay: dict[TP, int] = {}
        try:
            for tp, (start, position) in stored.items():
                self._check_position(tp, position)
                known = self._c.committed_offset(tp)
                if known is not None and known >= position:
                    continue  # a stale fetch of records this owner has already committed in Kafka too
                if known is not None and known > start:
                    start = known  # (Kafka commits at unit boundaries, so the outbox is keyed from there)
                outputs = database.stored_outputs(tp, start, position)
                log.warning(
                    "listener %s: %s[%d] %d..%d already committed in the database but not in Kafka (a crash "
                    "between the two commits?): producing its %d stored record(s) instead of running the handler",
                    self.listener,
                    tp[0],
                    tp[1],
                    start,
                    position - 1,
                    len(outputs),
                )
                for out in outputs:
                    self.produce(out)
                replay[tp] = position
        finally:
            producer.recorder = recorder
        if replay:
            self.send_offsets(replay)
        self.commit()
        committed = {tp: self._c.committed_offset(tp) for tp in stored}
        rewind(
            self._c,
            self.messages,
            at={tp: max(stored[tp][1], o if o is not None else -1) for tp, o in committed.items()},
        )

    def _check_position(self, tp: TP, position: int) -> None:
        """A stored position past the end of the partition was not written for this log: refuse it."""
        consumer = self._c.consumer
        marks = consumer.get_watermark_offsets(TopicPartition(*tp), cached=True) if consumer is not None else None
        if marks and marks[1] >= 0 and position > marks[1]:
            raise InvalidConfigurationError(
                f"listener {self.listener!r}: the database says {tp[0]}[{tp[1]}] is done up to offset {position} "
                f"(table kafkatx_offsets, group {self.group_id!r}), but the partition ends at {marks[1]}: the "
                "database was written for another Kafka cluster, or the topic was deleted and created again. "
                "kafkatx does not skip records on its word: delete the group's rows from kafkatx_offsets and "
                "kafkatx_outbox, or use the database that goes with this cluster"
            )

    def isolate(self, exc: BaseException, records: int) -> None:
        """The database commit of several records failed (a deferred constraint): handle them one per transaction.

        Nothing was committed on either side. The crash guard's careful mode
        runs each record of the unit in a transaction of its own, so the next
        commit that fails is one record's, and the failure policy decides about
        that record alone; its batch-mates commit.
        """
        self.abort(records, f"database commit failed: {type(exc).__name__}")
        first, until = first_offsets(self.messages), self.next_offsets()
        log.warning(
            "listener %s: the database commit of a unit of %d records failed (%s: %s), which does not say which "
            "record caused it: handling %s one record per transaction to find it",
            self.listener,
            len(self.messages),
            type(exc).__name__,
            str(exc).strip().splitlines()[0] if str(exc).strip() else "",
            ", ".join(f"{t}[{p}] {first[(t, p)]}..{until[(t, p)] - 1}" for t, p in sorted(first)),
        )
        self._c.guard.isolate(until)
        self.rewind()

    def wait_for_database(self, exc: DatabaseUnavailableError, records: int) -> None:
        """Nothing committed on either side: an outage, not a record's failure (see :mod:`kafkatx.listener.failure.outage`).

        The unit is fetched again once the listener's outage ends; every
        container of the listener waits meanwhile.
        """
        self.abort(records, str(exc))
        self.rewind()
        first = self.messages[0] if self.messages else None
        record = None
        if first is not None:
            record = to_record(first, self._c.tracker.attempt(first.topic(), first.partition(), first.offset()))
        self._c.outage.report(self._c.worker, exc, record)
