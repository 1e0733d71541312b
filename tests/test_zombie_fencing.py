"""Seed 001: a worker stalls inside a transaction, its partition moves on, then it wakes up.

Both fencing modes must give exactly one output per input:

- ``fencing="partition"`` (KIP-98): the new owner's producer uses the same
  transactional.id (``<prefix>-<group>.<topic>.<partition>``); its
  init_transactions aborts the zombie's open transaction and fences it, so the
  zombie's commit fails.
- ``fencing="group"`` (KIP-447): producers have per-instance ids, so nothing
  fences the zombie's producer by id. On Apache Kafka the broker refuses
  offsets sent with a stale consumer generation, and the new owner's offset
  fetch waits while the zombie's offsets are pending. noida-db does not make
  that fetch wait (it returns the old offset at once), so kafkatx adds a
  client-side guard: right before committing, the container checks that its
  consumer is still the group member that sent the offsets; a worker that
  stalled past max.poll.interval.ms has left the group, so it aborts.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition

from kafkatx import App, Record
from kafkatx.events import PartitionsAssigned, ProducerRecreated, TransactionAborted
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

FAST_GROUP = {"session.timeout.ms": 6000, "max.poll.interval.ms": 6000, "heartbeat.interval.ms": 500}


def worker(kafka: KafkaTestKit, name: str, instance: str, src: str, out: str, fencing: str, calls: Counter[str]) -> App:
    # Dynamic membership: the zombie is a member that stalled past max.poll.interval.ms and was replaced.
    app = App(
        name,
        bootstrap_servers=kafka.bootstrap_servers,
        instance_id=instance,
        consumer_config=FAST_GROUP,
        static_membership=False,
    )

    @app.listener(src, output=out, fencing=fencing, max_batch_records=1)
    def handle(record: Record) -> bytes:
        calls[instance] += 1
        return b"out-" + (record.value or b"")

    return app


class _StallingClient:
    """confluent-kafka's Producer, whose next commit_transaction stalls (after the offsets went to the broker)."""

    def __init__(self, client: Producer, stalled: threading.Event, release: threading.Event) -> None:
        self._client, self._stalled, self._release = client, stalled, release

    def commit_transaction(self, *args: Any) -> Any:
        if not self._stalled.is_set():
            self._stalled.set()
            self._release.wait(60)
        return self._client.commit_transaction(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


def stall(app: App, when: str, stalled: threading.Event, release: threading.Event) -> None:
    """Make the app's next transaction stall: before it sends its offsets, before it commits (before the
    membership check), or inside the client's commit_transaction (the offsets already in the transaction)."""
    container = app.containers[0]
    producer = container._group_producer or next(iter(container._partition_producers.values()))
    if when == "in_commit":
        producer._producer = _StallingClient(producer.ensure(), stalled, release)  # type: ignore[assignment]
        return
    method = "commit" if when == "before_commit" else "send_offsets"
    original = getattr(producer, method)

    def stalled_call(*args: Any, **kwargs: Any) -> Any:
        if not stalled.is_set():
            stalled.set()
            release.wait(60)
        return original(*args, **kwargs)

    setattr(producer, method, stalled_call)


@pytest.mark.parametrize(
    ("fencing", "when"),
    [
        ("partition", "in_commit"),
        ("partition", "before_commit"),
        ("group", "before_commit"),
        ("group", "before_offsets"),
    ],
)
def test_zombie_wakes_up_after_rebalance_without_duplicates(
    request: pytest.FixtureRequest, kafka: KafkaTestKit, fencing: str, when: str
) -> None:
    src, out = kafka.topic(), kafka.topic()
    name = unique_name("zombie")
    calls: Counter[str] = Counter()
    w1 = worker(kafka, name, "w1", src, out, fencing, calls)
    w2 = worker(kafka, name, "w2", src, out, fencing, calls)
    recreated: list[ProducerRecreated] = []
    w1.on(ProducerRecreated)(recreated.append)
    aborted: list[TransactionAborted] = []
    w1.on(TransactionAborted)(aborted.append)
    w1_assigned, w2_assigned = threading.Event(), threading.Event()
    # PartitionsAssigned is published after the new partitions' producers are ready (partition fencing
    # creates them in the callback): the stall must wrap the client the container will use.
    w1.on(PartitionsAssigned)(lambda e: e.partitions and w1_assigned.set())
    w2.on(PartitionsAssigned)(lambda e: e.partitions and w2_assigned.set())
    stalled, release = threading.Event(), threading.Event()
    w1.start()
    try:
        assert w1_assigned.wait(20), "worker 1 assigned"
        stall(w1, when, stalled, release)
        kafka.produce(src, [b"A"])
        assert stalled.wait(20), "worker 1 stalls inside its transaction"
        w2.start()
        assert w2_assigned.wait(30), "the partition moves to worker 2 while worker 1 is stuck"
        if not request.config.getoption("--kafka-bootstrap") or when == "before_offsets":
            # Worker 2 handles A (and commits it) while worker 1 is stuck: the zombie's A would be a duplicate.
            # A KIP-447 broker makes worker 2's offset fetch wait for worker 1's pending offsets instead.
            wait_for(lambda: calls["w2"] >= 1, 30, message="worker 2 handled A")
        release.set()  # the zombie wakes up and tries to finish its transaction
        kafka.produce(src, [b"B", b"C"])
        wait_for(lambda: kafka.committed(name, src) == {0: 3}, 40, message="all inputs committed")
    finally:
        release.set()
        w1.stop(wait=False)
        w2.stop(wait=False)
        w1.stop()
        w2.stop()
    outputs = kafka.values(out)
    assert Counter(outputs) == Counter([b"out-A", b"out-B", b"out-C"]), outputs
    if fencing == "partition" and when == "in_commit":
        assert recreated, "the zombie's producer was fenced by the new owner's init_transactions"
        assert "FENCED" in str(recreated[0].error).upper()
    elif fencing == "partition":
        # Woken before its commit: the membership check stops it first, or its fenced producer does.
        assert recreated or any("membership changed" in a.reason for a in aborted), (recreated, aborted)
    elif request.config.getoption("--kafka-bootstrap"):
        # A KIP-447 broker may refuse the stale-generation offsets itself (ILLEGAL_GENERATION /
        # UNKNOWN_MEMBER_ID: producer recreated) before the membership guard gets to look.
        assert recreated or any("membership changed" in a.reason for a in aborted), (recreated, aborted)
    else:
        # The local broker accepts offsets with a stale generation (no KIP-447): only kafkatx's
        # membership check before the commit stands between the zombie and a duplicate.
        assert any("membership changed" in a.reason for a in aborted), (recreated, aborted)


def test_why_partition_mode_needs_a_stable_transactional_id(kafka: KafkaTestKit) -> None:
    """The seed-001 failure, hand-written with confluent-kafka, then fixed by a stable id.

    Worker 2 reads committed offsets like a pre-KIP-447 client (no wait for
    pending transactional offsets). With a random transactional.id, its
    init_transactions does not fence worker 1, which later commits too:
    input A is processed twice. With the per-partition id kafkatx uses,
    worker 2's init_transactions aborts worker 1's transaction and fences it.
    """
    for stable in (False, True):
        src, out = kafka.topic(), kafka.topic()
        group = unique_name("g")
        kafka.produce(src, [b"A"])
        txn_id = f"app-{group}.{src}.0"
        tp = TopicPartition(src, 0)

        def consumer(isolation: str) -> Consumer:
            c = Consumer(
                {
                    "bootstrap.servers": kafka.bootstrap_servers,
                    "group.id": group,
                    "enable.auto.commit": False,
                    "isolation.level": isolation,
                    "auto.offset.reset": "earliest",
                    "log_level": 3,
                }
            )
            c.assign([tp])
            return c

        def producer(tid: str) -> Producer:
            p = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": tid, "log_level": 3})
            p.init_transactions(10)
            return p

        c1 = consumer("read_committed")
        p1 = producer(txn_id if stable else unique_name("random"))
        (msg,) = c1.consume(1, 10)
        p1.begin_transaction()
        p1.produce(out, b"B-from-worker-1")
        p1.send_offsets_to_transaction([TopicPartition(src, 0, msg.offset() + 1)], c1.consumer_group_metadata(), 10)
        # ... worker 1 stalls here; the partition is handed to worker 2

        c2 = consumer("read_uncommitted")  # reads the committed offset without waiting for pending ones
        p2 = producer(txn_id if stable else unique_name("random"))
        (msg2,) = c2.consume(1, 10)
        assert msg2.value() == b"A", "worker 2 starts from the last committed offset"
        p2.begin_transaction()
        p2.produce(out, b"B-from-worker-2")
        p2.send_offsets_to_transaction([TopicPartition(src, 0, msg2.offset() + 1)], c2.consumer_group_metadata(), 10)
        p2.commit_transaction(10)

        if stable:
            with pytest.raises(KafkaException) as info:
                p1.commit_transaction(10)  # the zombie wakes up
            assert info.value.args[0].fatal() and info.value.args[0].code() == KafkaError._FENCED
            assert kafka.values(out) == [b"B-from-worker-2"], "no duplicate with a stable id"
        else:
            p1.commit_transaction(10)  # nothing fences it
            assert sorted(kafka.values(out)) == [b"B-from-worker-1", b"B-from-worker-2"], "A was processed twice"
        c1.close()
        c2.close()


def test_partition_mode_a_fenced_worker_does_not_fence_the_new_owner_back(
    kafka: KafkaTestKit, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker fenced on a partition's transactional.id must not start a new producer with it
    at once: the partition has most likely moved to a consumer it has not heard of yet, and
    taking the id back would fence that owner in turn, so both would commit the same records
    (seen on noida-db when its group reassigned partitions before the old member knew)."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"%d" % i for i in range(400)])
    name = unique_name("pfence")
    app = App(name, bootstrap_servers=kafka.bootstrap_servers, instance_id="w1")
    recreated: list[Any] = []

    @app.listener(src, output=out, fencing="partition", max_batch_records=5)
    def slow(record: Record) -> bytes:
        time.sleep(0.01)
        return record.value or b""

    app.on(ProducerRecreated)(recreated.append)
    with running(app):
        wait_for(lambda: sum(kafka.committed(name, src).values()) > 20, 30, message="the worker is committing")
        # The "new owner": the partition's own transactional.id, initialised elsewhere.
        owner = Producer(
            {
                "bootstrap.servers": kafka.bootstrap_servers,
                "transactional.id": app.partition_transactional_id(name, src, 0),
            }
        )
        owner.init_transactions(30)
        wait_for(lambda: recreated, 30, message="the worker saw it was fenced")
        wait_for(
            lambda: any("after fencing" in r.getMessage() for r in caplog.records),
            10,
            message="the worker holds the partition instead of taking the id back",
        )
        owner.begin_transaction()
        owner.produce(out, b"from-the-new-owner")
        owner.commit_transaction(30)  # fails with _FENCED if the worker re-initialised the id
    assert b"from-the-new-owner" in kafka.values(out)
