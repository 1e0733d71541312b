"""Crash counting: attempt counts that survive the process, and records that kill it.

The state lives in offset-commit metadata (:mod:`kafkatx.rollback.durable`).
This module is the container's side of it:

- every commit claims the range it hands over next as in flight, up to a
  batch (:meth:`CrashGuard.metadata`), and a clean stop or revoke withdraws
  the claims (:meth:`CrashGuard.release`): a claim still standing at the next
  start means the process died;
- on assignment, a claim still standing means the previous owner died while
  handling the range it names (:meth:`CrashGuard.restore`). If that is one
  record, it is counted against it; if several, they are the suspects of a
  bisection (:mod:`kafkatx.rollback.bisection`): the first half is handled
  in one transaction whose claim names only that half, and so on, so that a
  second crash narrows the range and the halves that pass commit as they
  pass (:meth:`CrashGuard.run_careful`). The rest of the partition, and every
  other partition, runs in full batches meanwhile;
- a record that has killed the process ``max_attempts`` times is recovered
  (dead-lettered) without calling the handler;
- a clean stop ends the search: the next run starts in full batches.

Record and batch listeners (a part is handed to the batch runner as a unit): a Spark job cannot be run one
record at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container, Mapping, Sequence, Set
from dataclasses import replace
from typing import Any

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP
from kafkatx.errors import ProcessCrashedError, RecoveryError
from kafkatx.events import CrashSearchNarrowed, RecordRecovered
from kafkatx.listener.failure.after_rollback import recovery_failed
from kafkatx.listener.host import HandlerFailure, TransactionHost
from kafkatx.listener.transaction.positions import rewind
from kafkatx.listener.transaction.unit import TransactionUnit, commit_offsets
from kafkatx.outputs import PendingOutput
from kafkatx.record import ConsumedMessage, Record, to_record
from kafkatx.rollback.bisection import Suspects, after_commit, claimed_suspects
from kafkatx.rollback.durable import PartitionState, decode, encode, inflight_claim_parts, process_token

__all__ = ["CrashGuard"]

log = logging.getLogger("kafkatx.container")


class CrashGuard:
    """Claims, the search for a record that killed the process, and crash recovery of one container."""

    def __init__(self, container: TransactionHost) -> None:
        self._c = container
        self.enabled = container.spec.count_crashes
        self._owner = process_token()  # written into in-flight claims: our own claim found again is no crash
        self._claim_head, self._claim_tail = inflight_claim_parts(self._owner)  # the usual claim: a batch from it
        self._searches: dict[TP, Suspects] = {}  # partitions with a suspect range, handled a part at a time
        self._pending: dict[TP, int] = {}  # partitions whose last commit claimed `offset` in flight
        self._marked: set[TP] = set()  # searched partitions whose next part is already claimed in flight
        #: Assigned partitions with no claim standing yet (nothing committed by this owner): their first
        #: batch is claimed with a marker transaction before it is handed over (see claim_first).
        self.unclaimed: set[TP] = set()

    @property
    def careful(self) -> Mapping[TP, int]:
        """The partitions whose records are handled a part at a time, and up to which offset (exclusive)."""
        return {tp: suspects.end for tp, suspects in self._searches.items()}

    # -- what commits say ------------------------------------------------------------
    def metadata(self, offsets: Mapping[TP, int]) -> dict[TP, str] | None:
        """The offset-commit metadata of a transaction committing ``offsets``: a claim of what comes next."""
        if not self.enabled:
            return None
        tracker, out = self._c.tracker, {}
        for tp, offset in offsets.items():
            suspects = self._searches.get(tp)
            state = tracker.state_at(tp[0], tp[1], offset)
            failures = state.failures if state else 0
            if suspects is not None and offset < suspects.end:
                out[tp] = self._claim(offset, suspects.next_end(offset), failures)
            elif state is None:
                out[tp] = f"{self._claim_head}{offset}{self._claim_tail}"  # the usual claim: a batch from `offset`
            else:
                out[tp] = encode(PartitionState(offset, failures, True, None, self._owner))
        return out

    def _claim(self, offset: int, until: int, failures: int) -> str:
        """A claim of ``[offset, until)`` in flight, less than a batch; of one record, readable as such by earlier
        versions too."""
        single = until if until == offset + 1 else None
        return encode(PartitionState(offset, failures, True, single, self._owner, until))

    def committed(self, offsets: Mapping[TP, int]) -> None:
        """A transaction whose offsets carried claims has committed: the claims stand."""
        if not self.enabled:
            return
        for tp, offset in offsets.items():
            self._pending[tp] = offset
            self.unclaimed.discard(tp)
            suspects = self._searches.get(tp)
            if suspects is None:
                continue
            if after_commit(suspects, offset) is None:
                del self._searches[tp]
                self._marked.discard(tp)
                log.info(
                    "listener %s: %s[%d] is past the range the crash claim named; full batches again", self._c.name, *tp
                )
            else:
                self._marked.add(tp)  # this commit's claim names the next part

    # -- the next owner ----------------------------------------------------------------
    def restore_from(self, consumer: Any, partitions: list[TopicPartition]) -> None:
        """Newly assigned ``partitions``: read their committed offsets with ``consumer`` and :meth:`restore`."""
        if not partitions:
            return
        try:
            committed = consumer.committed([TopicPartition(p.topic, p.partition) for p in partitions], timeout=10)
        except Exception as exc:
            where = ", ".join(f"{p.topic}[{p.partition}]" for p in partitions)
            log.warning(
                "listener %s: could not read committed offsets of %s (%s); attempt counts start at 1",
                self._c.name,
                where,
                exc,
            )
            return
        self.restore(committed)

    def restore(self, committed: list[TopicPartition]) -> None:
        """Read what the previous owner committed: seed counts, and after a crash start the search."""
        c = self._c
        if self.enabled:
            self.unclaimed.update((tp.topic, tp.partition) for tp in committed if tp.topic is not None)
        for tp in committed:
            if tp.offset < 0 or tp.topic is None:
                continue
            state = decode(tp.metadata, tp.offset)
            if state is None:
                continue
            key, failures, suspects = (tp.topic, tp.partition), state.failures, None
            if state.inflight and self.enabled and state.owner == self._owner:
                # Our own claim, from before this process lost the partition (a rebalance, a broker restart):
                # whatever was in flight was aborted or fenced, not a crash.
                log.debug(
                    "listener %s: %s[%d] comes back with this process's own claim at %d: no crash",
                    c.name,
                    *key,
                    tp.offset,
                )
            elif state.inflight and self.enabled:
                # The claim is now this owner's to withdraw at a clean stop, as its own would be: one that ends
                # before anything is handled (the previous owner died idle) must not be found again next start.
                self._pending[key] = tp.offset
                suspects, blamed = claimed_suspects(
                    tp.offset, state.inflight_until, state.careful_until, self._claimable(tp)
                )
                if blamed:
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
                    log.warning(
                        "listener %s: the previous owner of %s[%d] died while handling offsets %d..%d; "
                        "handling halves of them, one transaction each, to find the record that killed it",
                        c.name,
                        *key,
                        tp.offset,
                        suspects.end - 1,
                    )
            if failures:
                c.tracker.seed(tp.topic, tp.partition, tp.offset, failures)
            if suspects is not None:
                self._searches[key] = suspects
                self._marked.discard(key)

    def _claimable(self, tp: TopicPartition) -> int:
        """How many records a batch claim at ``tp.offset`` can have covered: a batch, and no more than the partition
        holds now (a retry partition's claim names a batch but holds a few records: fewer crashes to find one)."""
        batch, consumer = self._c.spec.max_batch_records, self._c.consumer
        if consumer is None:
            return batch
        try:
            high = int(consumer.get_watermark_offsets(TopicPartition(tp.topic, tp.partition), timeout=5)[1])
        except Exception:
            return batch
        return min(batch, high - tp.offset) if high > tp.offset else batch

    def release(self, tps: list[TP]) -> None:
        """A clean stop or revoke: withdraw the in-flight claims, and end any search.

        Nothing crashed, so no claim is true: a batch that was handed and not
        committed was aborted (its failures, if any, are in the tracker, and
        are kept). A search is not handed on: if a suspect record kills its
        next owner, that owner's claim starts a search of its own.
        """
        claims = {tp: self._pending.pop(tp) for tp in tps if tp in self._pending}
        try:
            self._withdraw(claims)
        finally:
            self.forget(tps)

    def _withdraw(self, claims: dict[TP, int]) -> None:
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
            meta[tp] = encode(PartitionState(offset, state.failures if state else 0))
        commit_offsets(self._c, claims, what="release", metadata=meta, tolerate_errors=True)

    def forget(self, tps: list[TP]) -> None:
        """Partitions lost (not revoked cleanly): drop what this owner knew of them."""
        for tp in tps:
            self._pending.pop(tp, None)
            self._searches.pop(tp, None)
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
        first = first_unclaimed(batch, self.unclaimed, self._searches)
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
                rewind(c, batch)
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
                rewind(c, batch, at=stale)  # nothing of this poll is handled: rewind it all
                return False
        claimed = commit_offsets(c, first, what="claim")
        if not claimed:
            unit = TransactionUnit(c, c.producer_for(next(iter(first))), batch)
            unit.rewind_to_committed()
        return claimed

    # -- handling suspects a part at a time -------------------------------------------------
    def isolate(self, until: Mapping[TP, int]) -> None:
        """Handle the partitions' records before ``until`` one per transaction (a database commit of several
        failed and cannot say whose record caused it; see TransactionUnit._isolate)."""
        for tp, offset in until.items():
            if self._c.owns(tp):
                known = self._searches.get(tp)
                self._searches[tp] = Suspects(max(known.end if known else offset, offset), halving=False)
                self._marked.discard(tp)

    def run_careful(
        self, batch: list[ConsumedMessage], runner: Callable[[TransactionUnit], None]
    ) -> list[ConsumedMessage]:
        """Handle the records of searched partitions a part per transaction; return the others, in order.

        A partition whose part does not commit (a record is retried after a
        back-off, or its recovery failed) gives up the rest of its records in
        this poll: they are fetched again in order. One whose search ends
        hands its remaining records back, to go with the full batches.
        """
        if not self._searches:
            return batch
        searched: dict[TP, list[ConsumedMessage]] = {}
        rest: list[ConsumedMessage] = []
        for msg in batch:
            tp = (msg.topic(), msg.partition())
            if tp in self._searches and self._c.owns(tp):
                searched.setdefault(tp, []).append(msg)
            else:
                rest.append(msg)
        for tp, msgs in searched.items():
            rest.extend(self._search(tp, msgs, runner))
        return rest

    def _search(
        self, tp: TP, msgs: list[ConsumedMessage], runner: Callable[[TransactionUnit], None]
    ) -> list[ConsumedMessage]:
        """Run one partition's records part by part while it is searched; what is left once the search ends."""
        c, i = self._c, 0
        while i < len(msgs):
            suspects = self._searches.get(tp)
            if suspects is None or not c.owns(tp):
                return msgs[i:]
            offset = msgs[i].offset()
            known = c.committed_offset(tp)
            if known is not None and offset < known:
                i += 1  # committed meanwhile (the database outbox finished a unit past it): never run it again
                continue
            end = suspects.next_end(offset)
            part = [msgs[i]]
            while i + len(part) < len(msgs) and msgs[i + len(part)].offset() < end:
                part.append(msgs[i + len(part)])
            if c.stop_event.is_set() or not self._run_part(tp, part, end, runner):
                if tp not in c.paused_until:  # a held record's pause already rewound it
                    committed = c.committed_offset(tp)
                    c.seek(tp, committed if committed is not None and committed <= offset else offset)
                return []
            i += len(part)
        return []

    def _run_part(
        self, tp: TP, part: list[ConsumedMessage], end: int, runner: Callable[[TransactionUnit], None]
    ) -> bool:
        """Handle ``part`` (within ``[its first offset, end)``) in one transaction, claimed first. True if it
        committed."""
        c = self._c
        first = part[0]
        offset = first.offset()
        producer = c.producer_for(tp)
        state = c.tracker.state_at(tp[0], tp[1], offset)
        failures = state.failures if state else 0
        if end == offset + 1 and failures >= c.spec.policy.max_attempts:
            return self._recover(first, failures)
        if tp not in self._marked:  # nothing committed yet claims this part in flight: do it now
            marker = self._claim(offset, end, failures)
            unit = TransactionUnit(c, producer, [])
            if not unit.transact(lambda: unit.send_offsets({tp: offset}, {tp: marker}), records=0, what="marker"):
                return False
        if end > offset + 1:
            c.publish(CrashSearchNarrowed(c.name, c.worker, tp[0], tp[1], offset, end))
        if len(part) > 1:
            log.info(
                "listener %s: handling %s[%d] offsets %d..%d in one transaction (crash search)",
                c.name,
                *tp,
                offset,
                part[-1].offset(),
            )
        self._marked.discard(tp)  # the claim is used up by this attempt
        runner(TransactionUnit(c, producer, part))
        committed = c.committed_offset(tp)
        return (
            committed is not None and committed > part[-1].offset()
        )  # (past it: a database replay can commit further)

    def _recover(self, msg: ConsumedMessage, crashes: int) -> bool:
        c = self._c
        tp, offset = (msg.topic(), msg.partition()), msg.offset()
        record: Record = to_record(msg, crashes)
        if c.retry_hops is not None:  # read back from a retry topic: recovered as its input record
            record = replace(c.retry_hops.view(record), attempt=crashes)
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


def first_unclaimed(batch: Sequence[ConsumedMessage], unclaimed: Set[TP], careful: Container[TP]) -> dict[TP, int]:
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
