"""The listener container: one consumer thread, its rebalance callbacks, and the poll loop of its stages.

Threading: each listener runs ``concurrency`` containers, each on its own
thread with its own Consumer and transactional Producer(s); nothing is shared
between them but the App's event bus. confluent-kafka releases the GIL while
it waits on the network, so threads overlap their I/O.

Per poll, a container takes up to ``max_batch_records`` records (waiting at
most ``max_batch_ms``) and splits them into transaction units (the whole
batch with ``fencing="group"``, each partition's slice with
``fencing="partition"``), each handed to the listener's runner
(:mod:`kafkatx.listener.runners.record_runner`, or a Spark job) as a
:class:`~kafkatx.listener.transaction.unit.TransactionUnit`. A transaction is never
open while the consumer polls, so a rebalance never finds one half done.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

from confluent_kafka import Consumer, Message, TopicPartition

from kafkatx.client.bounded import BoundedCaller, CallInProgress
from kafkatx.client.offsets import TP
from kafkatx.client.partitions import partition_list
from kafkatx.client.producer import TransactionalProducer
from kafkatx.database.session import DatabaseSession
from kafkatx.errors import (
    FencedTooOftenError,
    GroupMembershipChanged,
    InvalidConfigurationError,
    KafkaTxError,
    StuckCallError,
)
from kafkatx.events import ContainerStarted, ContainerStopped, Event, PartitionsAssigned, PartitionsRevoked
from kafkatx.listener.failure.crash_guard import CrashGuard
from kafkatx.listener.failure.outage import ListenerOutage, OutageHold
from kafkatx.listener.failure.reactions import KafkaErrorReactions
from kafkatx.listener.host import Runner
from kafkatx.listener.loop.batch_fill import BatchFill
from kafkatx.listener.loop.brokers import BrokerWatch
from kafkatx.listener.loop.health import StallCheck, UnassignedWatch, blocked_producer
from kafkatx.listener.loop.idle import IdleDuties
from kafkatx.listener.loop.overlap import overlap_of
from kafkatx.listener.loop.partition_turns import partition_stage
from kafkatx.listener.loop.quiet_partitions import QuietPartitions
from kafkatx.listener.loop.retry_feed import RetryFeed
from kafkatx.listener.loop.retry_stalls import RetryStalls
from kafkatx.listener.loop.time_limits import fence_hold, transaction_budget
from kafkatx.listener.runners.record_runner import RecordRunner
from kafkatx.listener.transaction.positions import records_to_handle
from kafkatx.listener.transaction.unit import TransactionUnit
from kafkatx.record import ConsumedMessage
from kafkatx.retry_topics.hops import RetryHops
from kafkatx.rollback.tracker import FailureTracker

if TYPE_CHECKING:
    from kafkatx.listener.runtime import Runtime
    from kafkatx.listener.spec import ListenerSpec

__all__ = ["ListenerContainer", "Runner"]

log = logging.getLogger("kafkatx.container")

_CLOSE_DEADLINE_S = 10.0  # how long leaving the group may take at exit


class ListenerContainer:
    """Runs one listener's consumer loop on its own thread.

    It implements :class:`~kafkatx.listener.host.ContainerHost`, every role port
    of the services its helpers (unit, crash guard, reactions, health checks)
    are written on; each helper is typed on the roles it uses.
    """

    def __init__(
        self,
        spec: ListenerSpec,
        runtime: Runtime[ListenerContainer],
        worker: int,
        txn_index: int,
        outage: ListenerOutage | None = None,
    ) -> None:
        self.spec = spec
        self.runtime = runtime
        self.worker = worker
        self.txn_index = txn_index
        self.group_id = spec.group_id or runtime.group_id
        self.name = spec.name if spec.concurrency == 1 else f"{spec.name}#{worker}"
        self.tracker = FailureTracker()
        self.reactions = KafkaErrorReactions(self)
        self.guard = CrashGuard(self)
        #: Shared by the listener's containers (the App builds one per listener): an outage pauses them all.
        self.outage = outage or ListenerOutage.for_listener(spec, runtime.events.publish)
        self._hold = OutageHold(self, self.reactions.consumer_error)
        self._held = False  # the outage hold polled last turn (asked once more when the hold ends)
        #: With ``database=``: the database transaction each Kafka transaction carries (committed first).
        self.database = DatabaseSession(spec.database, self.group_id, self.name) if spec.database is not None else None
        if self.database is not None and spec.kind == "record":  # outputs kept per input partition (as BatchRunner)
            spec = self.spec = replace(spec, handler=self.database.attributing(spec.handler))
        self.failure: BaseException | None = None
        self.stop_reason = "normal"
        self.stop_event = threading.Event()
        self.started = threading.Event()
        self.consumer: Consumer | None = None
        self.assigned: set[TP] = set()
        self._thread: threading.Thread | None = None
        self._group_producer: TransactionalProducer | None = None
        self._partition_producers: dict[TP, TransactionalProducer] = {}
        self._paused_until: dict[TP, float] = {}
        #: Records of a paused partition kept in memory through a back-off, handled when the pause ends.
        self._deferred: dict[TP, list[ConsumedMessage]] = {}
        self._committed: dict[TP, int] = {}  # next offset committed per partition, as far as we know
        self._membership: bytes | None = None  # group metadata verified by the last commit; None after a rebalance
        self.polled_at = time.monotonic()
        self._handled_at = self.polled_at  # when records were last handled or committed: the idle stage's clock
        self._idle = IdleDuties(self, spec.idle_event_interval)  # listener/loop/idle.py: the loop's idle stage
        self._stall_check = StallCheck(self)
        #: The embedded broker: input partitions read to their end wait paused a moment (quiet_partitions.py).
        self._quiet = None if runtime.broker_holds_empty_fetches or spec.overlap_commit else QuietPartitions(self)
        #: Since when (time.monotonic()) the container has been handling a batch; None between batches.
        self.handling_since: float | None = None
        #: Set once the group gave this container its assignment (maybe empty) since start.
        self.assignment_received = threading.Event()
        self.consumer_config = runtime.consumer_config(spec, self.group_id, worker)
        #: Whether the cluster answers (listener/loop/brokers.py): fed by the consumer's error_cb and the idle stage.
        bootstrap = str(self.consumer_config.get("bootstrap.servers", "the cluster"))
        self.brokers = BrokerWatch(self.name, worker, bootstrap, self.publish)
        self.consumer_config["error_cb"] = self.brokers.error_cb(self.consumer_config.get("error_cb"))
        self.transaction_budget = transaction_budget(spec, runtime.transaction_timeout_ms, self.consumer_config)
        self.fence_hold = fence_hold(self.consumer_config)
        self._unassigned = UnassignedWatch(self, self.consumer_config)
        #: ``retry="topics"``: the retry partitions' consumer (retry_feed.py); without retry topics, it holds none.
        self.retry_hops = RetryHops.of(spec, self.group_id, self.publish, container=self.name, worker=worker)
        stalls = RetryStalls(self.retry_hops, self.name, worker, self.publish)  # due records not consumed
        self._feed = RetryFeed(self.retry_hops, self.consumer_config, self.name, stalls)
        self._build_loop(spec)

    def _build_loop(self, spec: ListenerSpec) -> None:
        """The loop's stages, of the features the listener uses: a feature it does not use is no stage at all."""
        #: A batch listener's poll, filled for up to ``max_batch_ms`` (batch_fill.py); None for a record listener.
        self._fill = None if spec.kind != "batch" else BatchFill(spec, self.stop_event, self.assigned)
        #: ``retry="topics"``: the retry partitions' due records, polled with each poll (None without retry topics).
        self._due_retries = (
            None if self.retry_hops is None else functools.partial(self._feed.poll, spec.max_batch_records, self)
        )
        factory = spec.runner
        # Any runner takes the TransactionUnits this container hands it (a Runner takes any Unit).
        self._runner: Callable[[TransactionUnit], None] = (
            factory(self) if factory is not None else RecordRunner(self, spec.processor)
        )
        #: ``overlap_commit=True``: records handled while a commit is under way (overlap.py); None otherwise.
        self._overlap = overlap_of(self, spec, self.guard, self.reactions, self._runner)
        #: What a turn asks before it polls, in order: the records handled during the last commit (only with
        #: ``overlap_commit=True``), the outage or operator's pause gate, the records whose back-off ended.
        held = () if self._overlap is None else (self._commit_held,)
        self._stages: tuple[Callable[[], bool], ...] = (*held, self._gate, self._resume_deferred)
        #: How a poll's batch is run: one unit, or with ``fencing="partition"`` one per partition (partition_turns.py).
        self._run_units = (
            partition_stage(self, self._runner, self._overlap, None if self.retry_hops is None else self._feed.input_of)
            if spec.fencing == "partition"
            else self._run_unit
        )

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"kafkatx-{self.name}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ask the loop to finish its current batch and close. Thread-safe, returns at once."""
        self.stop_event.set()

    def join(self, timeout: float | None = None) -> bool:
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    @property
    def thread(self) -> threading.Thread | None:
        """The thread this container runs on, once started."""
        return self._thread

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def assignment(self) -> set[TP]:
        return set(self.assigned)

    @property
    def paused_until(self) -> Mapping[TP, float]:
        """The partitions kafkatx holds (a back-off, fencing), and until when (``time.monotonic()``)."""
        return self._paused_until

    def mark_polled(self) -> None:
        """A poll outside the loop's own (the outage hold's, the overlapped commit's) returned: /livez times it."""
        self.polled_at = time.monotonic()

    @property
    def max_producer_recreations(self) -> int:
        """How many producer replacements within a minute stop the container (the App's setting)."""
        return self.runtime.max_producer_recreations

    @property
    def stalled_partitions(self) -> frozenset[TP]:
        """Owned partitions with records behind their position that fetched nothing for a while (StallCheck)."""
        return frozenset(self._stall_check.stalled)

    @property
    def stalled_retry_partitions(self) -> frozenset[TP]:
        """Retry partitions whose record due first was not consumed for a check interval (retry_stalls.py)."""
        return frozenset(self._feed.stalls.stalled)

    def blocked_call(self) -> CallInProgress | None:
        """The bounded client call this container's thread is blocked in, if any (for the liveness probe)."""
        blocked = blocked_producer([self._group_producer, *list(self._partition_producers.values())])
        return None if blocked is None else blocked.blocked_in

    def blocked_in(self) -> str | None:
        """The client call this container's thread is blocked in, if any (for shutdown messages)."""
        blocked = blocked_producer([self._group_producer, *list(self._partition_producers.values())])
        call = None if blocked is None else blocked.blocked_in
        return None if blocked is None or call is None else f"{call.describe()} on producer {blocked.transactional_id}"

    def publish(self, event: Event) -> None:
        if event.worker != self.worker or event.listener != self.name:
            event = replace(event, listener=self.name, worker=self.worker)
        self.runtime.events.publish(event)

    def _main(self) -> None:
        try:
            self._open()
            self.polled_at = time.monotonic()  # /livez times consume() from here, not from before _open()
            self.started.set()
            self.publish(ContainerStarted(self.name, self.worker, self.spec.topics))
            while not self.stop_event.is_set():
                self._poll_and_process()
        except (InvalidConfigurationError, FencedTooOftenError) as exc:
            self.failure, self.stop_reason = exc, "config" if isinstance(exc, InvalidConfigurationError) else "fenced"
            log.error("listener %s stopped: %s", self.name, exc)
        except BaseException as exc:  # noqa: BLE001 - the thread must report, not vanish
            self.failure, self.stop_reason = exc, "error"
            if isinstance(exc, KafkaTxError):
                log.error("listener %s stopped: %s", self.name, exc)
            else:
                log.exception("listener %s stopped by an unexpected error", self.name)
        finally:
            self.started.set()
            self._close()
            self.publish(ContainerStopped(self.name, self.worker, self.stop_reason, self.failure))
            self.runtime.container_exited(self)

    def _open(self) -> None:
        spec = self.spec
        if spec.fencing == "group":
            # init_transactions now: it fences a predecessor and aborts its open transaction before any fetch
            self._group_producer = self._new_producer(
                self.runtime.group_transactional_id(self.group_id, self.txn_index)
            )
            self._group_producer.ensure()
        self._feed.open()
        self.consumer = Consumer(self.consumer_config)
        self.consumer.subscribe(
            list(spec.topics), on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )
        log.info(
            "listener %s consuming %s as group %r (fencing=%s, batch<=%d records/%d ms%s)",
            self.name,
            ",".join(spec.topics),
            self.group_id,
            spec.fencing,
            spec.max_batch_records,
            spec.max_batch_ms,
            f", in_flight={spec.in_flight} ordering={spec.ordering}" if spec.in_flight > 1 else "",
        )

    def _close(self) -> None:
        if self.consumer is not None and self.failure is None:
            # A clean stop: nothing crashed, so withdraw the in-flight claims (the consumer's close
            # revokes the partitions too, but by then this container no longer commits).
            try:
                self.guard.release(sorted(self.assigned))
            except Exception:
                log.debug("withdrawing in-flight claims at close failed", exc_info=True)
        consumer, self.consumer = self.consumer, None
        if consumer is not None:
            try:
                # Leaves the group (on_revoke runs and closes partition producers), within a bound:
                # a broker that stopped answering must not keep the process from exiting.
                BoundedCaller(self.name).call("consumer.close", consumer.close, _CLOSE_DEADLINE_S)
            except StuckCallError:
                log.warning(
                    "listener %s: leaving the group did not finish within %.0fs; exiting anyway "
                    "(the group notices after session.timeout.ms)",
                    self.name,
                    _CLOSE_DEADLINE_S,
                )
            except Exception:
                log.debug("consumer close failed", exc_info=True)
        self._feed.close()
        if self.database is not None:
            self.database.close()
        close = getattr(self._runner, "close", None)  # the record runner's threads, a batch runner's event loop
        if callable(close):
            close()
        for producer in [*self._partition_producers.values(), *filter(None, [self._group_producer])]:
            producer.close()
        self._partition_producers.clear()

    def _new_producer(self, transactional_id: str) -> TransactionalProducer:
        return TransactionalProducer(
            self.runtime.producer_config(self.spec, transactional_id),
            transactional_id,
            retry_timeout=self.runtime.transaction_retry_timeout,
            on_retry=self.reactions.on_retry,
        )

    def committed_offset(self, tp: TP) -> int | None:
        """The next offset of ``tp`` this container committed last, if any."""
        return self._committed.get(tp)

    def producer_for(self, tp: TP) -> TransactionalProducer:
        """The transactional producer that commits ``tp``'s offsets."""
        if self._group_producer is not None:
            return self._group_producer
        producer = self._partition_producers.get(tp)
        if producer is None:
            origin = self._feed.input_of(tp)  # a retry partition's offsets commit with its input partition's
            if origin != tp:
                return self.producer_for(origin)
            producer = self._new_producer(self.runtime.partition_transactional_id(self.group_id, *tp))
            self._partition_producers[tp] = producer
        return producer

    # -- rebalance callbacks (run inside consume()) --------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._overlap is not None:
            self._overlap.rebalancing()  # a commit under way finishes first; what was handled meanwhile is given up
        self._membership = None
        tps = [(p.topic, p.partition) for p in partitions]
        self.assigned.update(tps)
        log.info("listener %s assigned %s", self.name, partition_list(tps))
        if partitions:
            # librdkafka keeps a partition's pause flag across revoke and re-assign; kafkatx's own
            # pauses end with the assignment they were made for, so a new assignment starts unpaused.
            try:
                consumer.resume(partitions)
            except Exception:
                log.debug("resume of newly assigned %s failed", tps, exc_info=True)
        if self.spec.fencing == "partition":
            for tp in tps:
                # KIP-98: the partition's fixed transactional.id fences its previous owner
                # and aborts whatever that owner left open.
                self.producer_for(tp).ensure()
        retry = [TopicPartition(t, p) for t, p in self._feed.assign(tps)]  # their retry partitions come with them
        self.guard.restore_from(consumer, partitions + retry)  # the failure counts a previous owner committed
        self.assignment_received.set()  # /readyz: only now can the container handle what it was given
        self.publish(PartitionsAssigned(self.name, self.worker, tuple(tps)))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition], lost: bool = False) -> None:
        if self._overlap is not None:
            self._overlap.rebalancing()  # the revoke returns only once a commit under way did
        self._membership = None
        inputs = [(p.topic, p.partition) for p in partitions]
        tps = inputs + self._feed.revoke(inputs)  # their retry partitions go with them
        if not lost:  # still ours until this callback returns: withdraw claims of batches that never started
            self.guard.release(tps)
        else:
            self.guard.forget(tps)
        self.assigned.difference_update(inputs)
        if not self.assigned:
            self._unassigned.restart()
        if self._fill is not None:
            self._fill.revoked(tps)
        self.tracker.clear_partitions(tps)
        for tp in tps:
            self._paused_until.pop(tp, None)
            self._deferred.pop(tp, None)  # its new owner starts from the committed offset
            self._committed.pop(tp, None)
            producer = self._partition_producers.pop(tp, None)
            if producer is not None:
                producer.close()
        log.info("listener %s %s %s", self.name, "lost" if lost else "revoked", partition_list(tps))
        self.publish(PartitionsRevoked(self.name, self.worker, tuple(tps), lost))

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._on_revoke(consumer, partitions, lost=True)

    # -- services of the transaction units -----------------------------------------
    def membership(self) -> Any:
        """The group metadata to send offsets with: the one the last commit verified, unless a
        rebalance callback ran since (one metadata round trip per transaction)."""
        if self._membership is not None:
            return self._membership
        assert self.consumer is not None
        return self.consumer.consumer_group_metadata()

    def membership_guard(self, membership: bytes) -> Callable[[], None]:
        """A pre-commit check that this consumer is still the group member that sent the offsets.

        A worker that stalled past max.poll.interval.ms has left the group by
        the time it wakes up; its partitions may be someone else's. Brokers
        with KIP-447 also make the new owner wait for our pending offsets, but
        checking here costs nothing and protects on brokers that do not.
        """

        def guard() -> None:
            consumer = self.consumer
            current = consumer.consumer_group_metadata() if consumer is not None else membership
            if current == membership:
                self._membership = current  # verified just now: the next transaction may send offsets with it
                return
            self._membership = None
            raise GroupMembershipChanged(
                f"listener {self.name!r}: group membership changed while the transaction was open "
                "(max.poll.interval.ms exceeded or a rebalance); aborting instead of committing"
            )

        return guard

    def committed(self, offsets: dict[TP, int]) -> None:
        """A transaction committed these next offsets."""
        if not self.assigned.issuperset(offsets):  # revoked during an overlapped commit (its callback saw it commit)
            offsets = {tp: offset for tp, offset in offsets.items() if self.owns(tp)}
        self._committed.update(offsets)
        self.guard.committed(offsets)
        if self.tracker.failing:
            self.tracker.committed(offsets)

    def seek(self, tp: TP, offset: int) -> None:
        deferred = self._deferred.get(tp)
        if deferred is not None and offset <= deferred[-1].offset():
            del self._deferred[tp]  # they are fetched again from there: handled from memory too, they would run twice
        if self._overlap is not None:
            self._overlap.touched(tp)
        consumer = self._positions_of(tp)
        if consumer is None:
            return
        self._feed.sought(tp, offset, held=tp in self._paused_until)  # a retry partition's waiting records: again
        try:
            consumer.seek(TopicPartition(tp[0], tp[1], offset))
        except Exception as exc:  # revoked meanwhile: its new owner starts from the committed offset
            log.debug("seek %s to %d skipped: %s", tp, offset, exc)

    def pause(self, tp: TP, seconds: float) -> None:
        """Hold a partition while the consumer keeps polling (no rebalance, other partitions flow)."""
        consumer = self._positions_of(tp)
        if seconds <= 0 or consumer is None or not self.owns(tp):
            return
        if self._overlap is not None:
            self._overlap.touched(tp)
        try:
            consumer.pause([TopicPartition(*tp)])
        except Exception:
            log.debug("pause of %s failed", tp, exc_info=True)
            return
        self._paused_until[tp] = max(self._paused_until.get(tp, 0.0), time.monotonic() + seconds)

    def owns(self, tp: TP) -> bool:
        """True if the container owns ``tp``: an assigned partition, or a retry partition mirrored from one."""
        return tp in self.assigned or tp in self._feed.assigned

    def _positions_of(self, tp: TP) -> Consumer | None:
        """The consumer fetching ``tp`` (the retry feed's for a retry partition): every seek, pause, resume."""
        return self._feed.consumer_of(tp, self.consumer)

    def defer(self, messages: list[ConsumedMessage], seconds: float) -> None:
        """Hold the partition of ``messages`` for ``seconds``, keeping them in memory to handle when it ends.

        Paused, its position moved past them: the back-off ends on time, with no fetch again (a long-poll wait).
        Revoked meanwhile, they are dropped: its next owner starts from the committed offset.
        """
        if not messages:
            return
        first = messages[0]
        tp = (first.topic(), first.partition())
        self.seek(tp, messages[-1].offset() + 1)
        self.pause(tp, seconds)
        if tp in self._paused_until:
            self._deferred[tp] = messages
        else:  # not paused (revoked, or no back-off after all): fetch them again
            self.seek(tp, first.offset())

    # -- the loop -------------------------------------------------------------
    def _poll_and_process(self) -> None:
        """One turn of the loop: the first of the listener's stages with work does it (``_stages``: those of the
        features it uses; a feature it does not use is no stage), else a poll."""
        self.handling_since = None  # the previous batch, if any, is done
        for stage in self._stages:
            if stage():
                return
        self._poll()

    def _commit_held(self) -> bool:
        """Commit the records handled while the last transaction committed (listener/loop/overlap.py), if any."""
        assert self._overlap is not None
        if not self._overlap.commit_held():
            return False
        self._handled_at = time.monotonic()
        return True

    def _gate(self) -> bool:
        """While an outage or an operator's pause holds the listener, its outage hold polls instead of the loop
        (listener/failure/outage.py); asked once more as the hold ends, to resume what it paused."""
        outage = self.outage
        if not (outage.active or outage.paused or self._held):
            return False
        self._held = self._hold.poll(self._handle_batch)
        return self._held

    def _poll(self) -> None:
        """Poll a batch and hand it on; when nothing came, the idle stage (listener/loop/idle.py)."""
        msgs = self._consume(self._poll_timeout())
        retries = self._due_retries() if self._due_retries is not None else None
        if not msgs and not retries:
            self._idle.run(self._handled_at)
            self.brokers.probe(self.consumer)
            return
        if self.brokers.down_since is not None:  # records came: the cluster answers again
            self.brokers.answered()
        batch = self._usable(msgs, self._paused_until if retries is None else self._feed.inputs_of(self._paused_until))
        if retries:  # the retry consumer's, checked against the retry partitions paused only
            batch += self._usable(retries, self._feed.held(self._paused_until))
        if batch:
            self._handle_batch(batch)

    def _poll_timeout(self) -> float:
        """A poll waits up to ``max_batch_ms`` (within 10-500 ms), and no longer than the next pause's end."""
        timeout = min(max(self.spec.max_batch_ms, 10), 500) / 1000.0
        wake = min(self._paused_until.values()) if self._paused_until else None
        if self._quiet is not None:
            wake = self._quiet.wake_by(wake)
        if wake is not None:  # wake up when the next pause ends, not a poll later
            timeout = max(0.0, min(timeout, wake - time.monotonic()))
        return timeout

    def _consume(self, timeout: float) -> list[Message]:
        """What the consumer has (a batch listener's batch filled for up to ``max_batch_ms``), with the checks
        that run once per poll (a stalled partition, no partitions at all)."""
        consumer, spec = self.consumer, self.spec
        assert consumer is not None
        msgs = consumer.consume(spec.max_batch_records, timeout)
        self.polled_at = time.monotonic()
        if msgs and self._fill is not None and len(msgs) < spec.max_batch_records:
            msgs = self._fill(consumer, msgs)
        if self._quiet is not None:  # the embedded broker: partitions at their end wait paused a moment
            self._quiet.after_poll()
        if self.polled_at >= self._stall_check.due:  # every STALL_CHECK_S (listener/loop/health.py)
            self._stall_check.run(self.polled_at)
        if not self.assigned:
            self._unassigned.maybe_warn(self.polled_at)
        return msgs

    def _usable(self, msgs: list[Message], paused: Collection[TP]) -> list[ConsumedMessage]:
        """``msgs`` (of one consumer) but the errors (each reported to the reactions) and the records of the
        ``paused`` partitions it fetches, paused since they were fetched (sought back, so that they come after the
        pause): all of them, usually. Asked per consumer, so that a retry partition held paused does not make
        every poll of the input look at each record, nor the reverse."""
        if paused or any(m.error() is not None for m in msgs):
            return records_to_handle(self, msgs, self.reactions.consumer_error, paused)
        return cast("list[ConsumedMessage]", msgs)  # no error: each has a topic, partition and offset

    def _handle_batch(self, batch: list[ConsumedMessage]) -> None:
        """Hand ``batch`` on as transaction units (partitions searched for a crash, and first claims, first)."""
        self.handling_since = self._handled_at = time.monotonic()
        batch = self.guard.run_careful(batch, self._runner)  # partitions searched for a crash, a part at a time
        if not batch:
            return
        if self.guard.unclaimed and not self.guard.claim_first(batch):
            return  # the claim did not commit (the group changed?): poll again before handing anything over
        self._run_units(batch)

    def _run_unit(self, batch: list[ConsumedMessage]) -> None:
        """``fencing="group"``: the whole batch is one unit, on the group's producer."""
        assert self._group_producer is not None
        self._runner(TransactionUnit(self, self._group_producer, batch, ahead=self._overlap))

    def _resume_deferred(self) -> bool:
        """Resume the partitions whose pause has ended, and handle the records deferred to that moment (see
        defer()), if any. True if it did."""
        now = time.monotonic()
        due = [tp for tp, until in self._paused_until.items() if until <= now]
        if not due or self.consumer is None:
            return False
        for tp in due:
            del self._paused_until[tp]
        self._feed.resume(due, self.consumer)  # each partition on the consumer that fetches it
        deferred = [m for tp in due for m in self._deferred.pop(tp, ())]
        if deferred:
            self._handle_batch(deferred)
        return bool(deferred)
