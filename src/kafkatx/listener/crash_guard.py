"""Crash counting: attempt counts that survive the process, and records that kill it.

The state lives in offset-commit metadata (:mod:`kafkatx.rollback.durable`).
This module is the container's side of it:

- every commit claims the next batch as in flight (:meth:`CrashGuard.metadata`),
  and a clean stop or revoke withdraws the claims (:meth:`CrashGuard.release`):
  a claim still standing at the next start means the process died;
- on assignment, a claim still standing means the previous owner died while
  handling (:meth:`CrashGuard.restore`): the partition's next
  ``max_batch_records`` records are handled one per transaction ("careful
  mode"), each commit marking the next record as in flight, so the record
  that kills the process again is counted;
- a record that has failed ``max_attempts`` times this way is recovered
  (dead-lettered) without calling the handler (:meth:`CrashGuard.run_careful`).

Record listeners only: a Spark job cannot be run one record at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence, Set

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP, first_offsets
from kafkatx.errors import KafkaClientError, ProcessCrashedError, RecoveryError
from kafkatx.events import RecordRecovered
from kafkatx.listener.after_rollback import recovery_failed
from kafkatx.listener.host import ContainerHost, HandlerFailure
from kafkatx.listener.unit import TransactionUnit, commit_offsets
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Record, to_record
from kafkatx.rollback.durable import PartitionState, decode, encode, encode_inflight, process_token

__all__ = ["CrashGuard"]

log = logging.getLogger("kafkatx.container")


class CrashGuard:
    """Claims, careful mode and crash recovery of one container."""

    def __init__(self, container: ContainerHost) -> None:
        self._c = container
        self.enabled = container.spec.count_crashes
        self._owner = process_token()  # written into in-flight claims: our own claim found again is no crash
        self._careful: dict[TP, int] = {}  # partition -> careful_until (exclusive)
        self._pending: dict[TP, int] = {}  # partitions whose last commit claimed `offset` in flight
        self._marked: set[TP] = set()  # careful partitions whose next record is already marked in flight
        #: Assigned partitions with no claim standing yet (nothing committed by this owner): their first
        #: batch is claimed with a marker transaction before it is handed over (see claim_first).
        self.unclaimed: set[TP] = set()

    @property
    def careful(self) -> Mapping[TP, int]:
        return self._careful

    # -- what commits say ------------------------------------------------------------
    def metadata(self, offsets: Mapping[TP, int]) -> dict[TP, str] | None:
        """The offset-commit metadata of a transaction committing ``offsets``."""
        if not self.enabled:
            return None
        tracker, out = self._c.tracker, {}
        for tp, offset in offsets.items():
            until = self._careful.get(tp)
            if until is not None and offset >= until:
                del self._careful[tp]
                self._marked.discard(tp)
                until = None
                log.info("listener %s: %s[%d] handled past the crash range; batches again", self._c.name, *tp)
            state = tracker.state_at(tp[0], tp[1], offset)
            if state is None and until is None:
                out[tp] = encode_inflight(offset, self._owner)  # the usual claim, once per partition and transaction
            else:
                out[tp] = encode(PartitionState(offset, state.failures if state else 0, True, until, self._owner))
        return out

    def committed(self, offsets: Mapping[TP, int]) -> None:
        """A transaction whose offsets carried claims has committed: the claims stand."""
        if not self.enabled:
            return
        for tp, offset in offsets.items():
            self._pending[tp] = offset
            self.unclaimed.discard(tp)
            if tp in self._careful:
                self._marked.add(tp)  # this commit's claim marks the next record in flight

    # -- the next owner ----------------------------------------------------------------
    def restore(self, committed: list[TopicPartition]) -> None:
        """Read what the previous owner committed; seed counts and enter careful mode after a crash."""
        c = self._c
        if self.enabled:
            self.unclaimed.update((tp.topic, tp.partition) for tp in committed if tp.topic is not None)
        for tp in committed:
            if tp.offset < 0 or tp.topic is None:
                continue
            state = decode(tp.metadata, tp.offset)
            if state is None:
                continue
            key, failures, until = (tp.topic, tp.partition), state.failures, state.careful_until
            if state.inflight and self.enabled and state.owner == self._owner:
                # Our own claim, from before this process lost the partition (a rebalance, a broker restart):
                # whatever was in flight was aborted or fenced, not a crash. Careful mode goes on where it was.
                log.debug(
                    "listener %s: %s[%d] comes back with this process's own claim at %d: no crash",
                    c.name,
                    *key,
                    tp.offset,
                )
            elif state.inflight and self.enabled:
                if until is not None and tp.offset < until:
                    failures += 1  # one record was in flight: it is the one that died
                    log.warning(
                        "listener %s: the previous owner of %s[%d] died while handling offset %d "
                        "(%d failed attempt(s) so far)",
                        c.name,
                        *key,
                        tp.offset,
                        failures,
                    )
                else:
                    until = tp.offset + c.spec.max_batch_records
                    log.warning(
                        "listener %s: the previous owner of %s[%d] died while handling a batch from offset %d; "
                        "handling offsets up to %d one per transaction to find the record that killed it",
                        c.name,
                        *key,
                        tp.offset,
                        until,
                    )
            if failures:
                c.tracker.seed(tp.topic, tp.partition, tp.offset, failures)
            if self.enabled and until is not None and until > tp.offset:
                self._careful[key] = until
                self._marked.discard(key)

    def release(self, tps: list[TP]) -> None:
        """A clean stop or revoke: withdraw the in-flight claims.

        Nothing crashed, so no claim is true: a batch that was handed and not
        committed was aborted (its failures, if any, are in the tracker, and
        are kept).
        """
        claims = {tp: self._pending.pop(tp) for tp in tps if tp in self._pending}
        consumer = self._c.consumer
        if not claims or consumer is None:
            return
        try:  # only where the claim is still the latest commit: never move an offset someone else committed
            current = consumer.committed([TopicPartition(t, p) for t, p in claims], timeout=5)
        except Exception:
            log.debug("could not read committed offsets before withdrawing claims", exc_info=True)
            return
        latest = {(tp.topic, tp.partition): tp.offset for tp in current}
        claims = {tp: offset for tp, offset in claims.items() if latest.get(tp) == offset}
        if not claims:
            return
        meta = {}
        for tp, offset in claims.items():
            state = self._c.tracker.state_at(tp[0], tp[1], offset)
            meta[tp] = encode(PartitionState(offset, state.failures if state else 0, False, self._careful.get(tp)))
        commit_offsets(self._c, claims, what="release", metadata=meta, tolerate_errors=True)
        for tp in tps:
            self._careful.pop(tp, None)
            self._marked.discard(tp)
            self.unclaimed.discard(tp)

    def forget(self, tps: list[TP]) -> None:
        """Partitions lost (not revoked cleanly): drop what this owner knew of them."""
        for tp in tps:
            self._pending.pop(tp, None)
            self._careful.pop(tp, None)
            self._marked.discard(tp)
            self.unclaimed.discard(tp)

    def claim_first(self, batch: list[ConsumedMessage]) -> bool:
        """Before the first batch of a partition this owner hands over: commit a claim for it.

        Every later commit claims the next batch by itself; the first one has
        no commit before it, and a crash inside it would otherwise go unseen.
        One small transaction per partition (per producer), once per assignment.
        False if a claim did not commit: the batch must not be handed over (its
        partitions may not be this consumer's any more); it is rewound.
        """
        first = first_unclaimed(batch, self.unclaimed, self._careful)
        if not first:
            return True
        c = self._c
        consumer = c.consumer
        if consumer is not None:
            # The first fetch after an assignment starts at the committed offset as the consumer last
            # read it. If another owner has committed past it since (a broker without KIP-447 does not
            # make the new owner wait for its predecessor's pending offsets), handling it would repeat
            # committed records, and claiming it would move the offset back: re-read from the commit.
            try:
                current = {
                    (tp.topic, tp.partition): tp.offset
                    for tp in consumer.committed([TopicPartition(*tp) for tp in first], timeout=10)
                }
            except Exception as exc:  # cannot tell: hand nothing over, fetch this poll again
                log.warning("listener %s: could not read the committed offsets of %s: %s", c.name, sorted(first), exc)
                for tp, offset in first_offsets(batch).items():
                    c.seek(tp, offset)
                return False
            stale = {tp: current[tp] for tp, offset in first.items() if current.get(tp, -1) > offset}
            if stale:
                for tp, offset in stale.items():
                    log.warning(
                        "listener %s: %s[%d] was fetched from %d but %d is committed: fetching again from the commit",
                        c.name,
                        tp[0],
                        tp[1],
                        first[tp],
                        offset,
                    )
                for tp, offset in first_offsets(batch).items():  # nothing of this poll is handled: rewind it all
                    c.seek(tp, stale.get(tp, offset))
                return False
        claimed = commit_offsets(c, first, what="claim")
        if not claimed:
            unit = TransactionUnit(c, c.producer_for(next(iter(first))), batch)
            unit.rewind_to_committed()
        return claimed

    # -- careful mode ----------------------------------------------------------------------
    def isolate(self, until: Mapping[TP, int]) -> None:
        """Handle the partitions' records before ``until`` one per transaction (a database commit of several
        failed and cannot say whose record caused it; see TransactionUnit._isolate)."""
        for tp, offset in until.items():
            if tp in self._c.assigned:
                self._careful[tp] = max(self._careful.get(tp, offset), offset)
                self._marked.discard(tp)

    def is_careful(self, msg: ConsumedMessage) -> bool:
        until = self._careful.get((msg.topic(), msg.partition()))
        return until is not None and msg.offset() < until

    def run_careful(self, msg: ConsumedMessage, runner: Callable[[TransactionUnit], None]) -> bool:
        """Handle one record of a careful partition in its own transaction. True if it was committed."""
        c = self._c
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        producer = c.producer_for(tp)
        state = c.tracker.state_at(tp[0], tp[1], offset)
        failures = state.failures if state else 0
        if failures >= c.spec.policy.max_attempts:
            return self._recover(msg, failures)
        if tp not in self._marked:  # nothing committed yet marks this record in flight: do it now
            marker = encode(PartitionState(offset, failures, True, self._careful.get(tp), self._owner))
            unit = TransactionUnit(c, producer, [])
            try:
                if not unit.transact(lambda: unit.send_offsets({tp: offset}, {tp: marker}), records=0, what="marker"):
                    return False
            except KafkaClientError:
                raise
            self._marked.add(tp)
        self._marked.discard(tp)  # the marker is used up by this attempt
        runner(TransactionUnit(c, producer, [msg]))
        committed = c.committed_offset(tp)
        return committed is not None and committed > offset  # (past it: a database replay can commit further)

    def _recover(self, msg: ConsumedMessage, crashes: int) -> bool:
        c = self._c
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        record: Record = to_record(msg, crashes)
        state = c.tracker.state_at(tp[0], tp[1], offset)
        # A failure this process saw (its recovery was rolled back with a batch-mate's transaction, e.g. an
        # output the broker refused) is recovered as what it was; a count read from a claim is a crash's.
        seen = state.last_exception if state is not None else None
        exc: BaseException = seen if seen is not None else ProcessCrashedError(record.coordinates, crashes)
        unit = TransactionUnit(c, c.producer_for(tp), [msg])
        log.error("listener %s: %s", c.name, exc)

        def work() -> None:
            unit.recover(c.spec.policy.recoverer, record, exc)
            unit.send_offsets({tp: offset + 1})

        error: RecoveryError | None = None
        try:
            if not unit.transact(work, what="recovery of a record that crashed the process"):
                return False
        except RecoveryError as err:
            error = err
        if error is not None:
            recovery_failed(unit, [msg], HandlerFailure(0, exc, record), error, _no_replay)
            return False
        c.publish(RecordRecovered(c.name, c.worker, record, exc, c.spec.policy.recoverer.name))
        return True


def first_unclaimed(batch: Sequence[ConsumedMessage], unclaimed: Set[TP], careful: Mapping[TP, int]) -> dict[TP, int]:
    """The first offset in ``batch`` of each partition in ``unclaimed`` (and not in ``careful``).

    Called for every poll until each assigned partition has delivered its
    first batch (a backlog is often read partition by partition, so that can
    be most of it): it looks at the head of each run of one partition's
    records only, not at every record.
    """
    first: dict[TP, int] = {}
    run_topic, run_partition = None, -1
    for msg in batch:
        partition, topic = msg.partition(), msg.topic()
        if partition == run_partition and topic == run_topic:
            continue
        run_topic, run_partition = topic, partition
        tp = (topic, partition)
        if tp in unclaimed and tp not in first and tp not in careful:
            first[tp] = msg.offset()
    return first


def _no_replay(record: Record) -> Sequence[PendingOutput]:
    raise AssertionError("a single-record unit has no batch-mates to replay")  # pragma: no cover
