"""The overlapped commit on the real broker: the next batch is handled while a transaction commits.

Each test holds the container's first commit in ``commit_transaction`` (a probe subclass of confluent-kafka's
Producer, as in test_fault_injection.py) until something has happened meanwhile: a record of the next batch was
handled (which proves the overlap: without it, nothing is handled before the commit returns, and the probe's wait
fails the test), a rebalance callback started, a stop was asked for. Then the commit goes on, or is made to fail by
fencing the producer for real. Outputs are read back read_committed: each exactly once.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import Producer

import kafkatx.producer as producer_module
from kafkatx import App, InvalidConfigurationError, Output, Record
from kafkatx.events import Event, PartitionsRevoked, ProducerRecreated, TransactionCommitted
from kafkatx.listener.loop.overlap import CommitOverlap
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pytestmark = pytest.mark.timeout(90)

_QUIET = {"log_level": 2}
_WAIT = 10.0  # seconds the held commit waits for what must happen meanwhile


class _CommitProbe:
    """Holds the first commit_transaction of a batch of records (``hook``, once ``armed()``) until ``hook`` returns.

    The commits before it (the crash guard's claim of the first batch) pass.
    """

    def __init__(self) -> None:
        self.armed: Callable[[], bool] = lambda: False
        self.hook: Callable[[], None] | None = None
        self.log: list[str] = []
        self.lock = threading.Lock()

    def take_hook(self) -> Callable[[], None] | None:
        with self.lock:
            if self.hook is None or not self.armed():
                return None
            hook, self.hook = self.hook, None
            return hook

    def note(self, what: str) -> None:
        with self.lock:
            self.log.append(what)

    def after(self, what: str) -> str:
        """What the log says next after ``what``."""
        return self.log[self.log.index(what) + 1]


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[_CommitProbe]:
    recorded = _CommitProbe()

    class ProbedProducer(Producer):  # type: ignore[misc]
        def commit_transaction(self, *args: Any) -> None:
            hook = recorded.take_hook()
            if hook is not None:
                hook()
            try:
                super().commit_transaction(*args)
            except BaseException:
                recorded.note("commit failed")
                raise
            recorded.note("commit returned")

    monkeypatch.setattr(producer_module, "Producer", ProbedProducer)
    yield recorded


def _app(kafka: KafkaTestKit, group: str | None = None, instance: str = "w1", **options: Any) -> App:
    return App(
        group or unique_name("overlap"),
        bootstrap_servers=kafka.bootstrap_servers,
        instance_id=instance,
        transaction_timeout_ms=60_000,  # the commit deadline (20 s) outlasts the probe's wait
        shutdown_timeout=15.0,
        config=dict(_QUIET),
        **options,
    )


#: Dynamic members that notice a rebalance fast (static members of two Apps in one process do not rebalance
#: on the embedded broker, see docs/research brokers.md).
_FAST_GROUP = {"session.timeout.ms": 6000, "max.poll.interval.ms": 6000, "heartbeat.interval.ms": 100}


def _values(n: int) -> list[bytes]:
    return [b"v%02d" % i for i in range(n)]


def _outputs(n: int) -> list[bytes]:
    return sorted(b"out-" + v for v in _values(n))


def _wait(event: threading.Event, what: str) -> None:
    if not event.wait(_WAIT):
        raise AssertionError(f"while the commit was held: {what} did not happen")


class _TwoWaves:
    """The first 5 records, then 15 more produced only once the commit of the 5th is under way (and held).

    A handler call for the second wave while that commit is held is the overlap, observed: without it the
    container handles nothing before the commit returns.
    """

    def __init__(self, kafka: KafkaTestKit, src: str, probe: _CommitProbe) -> None:
        self.kafka, self.src, self.probe = kafka, src, probe
        self.handled: list[bytes] = []
        self.lock = threading.Lock()
        self.ahead = threading.Event()
        kafka.produce(src, _values(5))

    def handle(self, record: Record) -> bytes:
        with self.lock:
            self.handled.append(record.value or b"")
        if record.value in _values(20)[5:]:
            self.ahead.set()
        return b"out-" + (record.value or b"")

    def hold_commit(self, then: Callable[[], None] = lambda: None) -> None:
        """Hold the commit of the transaction that has the 5th record until the second wave is handled."""

        def hook() -> None:
            self.kafka.produce(self.src, _values(20)[5:])
            _wait(self.ahead, "a record of the second wave handled")
            self.probe.note("handled ahead")
            then()

        self.probe.armed, self.probe.hook = lambda: len(self.handled) >= 5, hook


def test_the_next_batch_is_handled_while_the_commit_is_under_way(kafka: KafkaTestKit, probe: _CommitProbe) -> None:
    src, dst = kafka.topic(partitions=1), kafka.topic(partitions=1)
    waves = _TwoWaves(kafka, src, probe)
    waves.hold_commit()
    app = _app(kafka)
    app.add_listener(waves.handle, src, output=dst, name="h", max_batch_records=5, overlap_commit=True)
    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 20}, 30, message="all 20 committed")
    assert app.failure is None
    assert probe.after("handled ahead") == "commit returned"
    assert sorted(kafka.values(dst)) == _outputs(20)
    assert sorted(waves.handled) == _values(20), "each record handled once"
    assert [c._overlap.committed_ahead > 0 for c in app.containers] == [True]


def test_a_commit_that_fails_while_the_next_batch_is_handled_gives_that_batch_up(
    kafka: KafkaTestKit, probe: _CommitProbe
) -> None:
    src, dst = kafka.topic(partitions=1), kafka.topic(partitions=1)
    waves = _TwoWaves(kafka, src, probe)
    app = _app(kafka)
    txn_id = app.partition_transactional_id(app.group_id, src, 0)  # the embedded broker: fencing="partition"
    events: list[Event] = []
    intruders: list[Producer] = []

    def fence() -> None:
        # Another producer takes the transactional.id over: the coordinator aborts the transaction being
        # committed, and its commit fails (fenced) while the second wave's outputs are held.
        intruder = Producer({"bootstrap.servers": kafka.bootstrap_servers, "transactional.id": txn_id, **_QUIET})
        intruder.init_transactions(10)
        intruders.append(intruder)

    waves.hold_commit(then=fence)
    app.add_listener(waves.handle, src, output=dst, name="h", max_batch_records=5, overlap_commit=True)
    app.on(Event)(events.append)
    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 20}, 40, message="all 20 committed")
    assert app.failure is None
    assert probe.after("handled ahead") == "commit failed"
    assert [e for e in events if isinstance(e, ProducerRecreated)], "the fenced producer was replaced"
    second = _values(20)[5:]
    assert any(waves.handled.count(v) == 2 for v in second), "what was handled ahead was handled again"
    # Exactly once for read_committed readers...
    assert sorted(kafka.values(dst)) == _outputs(20)
    # ...and what was handled ahead of the failed commit never reached the broker: held, then given up.
    uncommitted = kafka.values(dst, isolation="read_uncommitted")
    assert all(uncommitted.count(b"out-" + v) == 1 for v in second), uncommitted


def test_a_rebalance_while_the_commit_is_under_way_waits_for_it(
    kafka: KafkaTestKit, probe: _CommitProbe, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=1)
    kafka.produce(src, [{"value": v, "partition": 0} for v in _values(5)])
    group = unique_name("overlap-rebalance")
    first, second = (
        _app(kafka, group, instance, consumer_config=_FAST_GROUP, static_membership=False) for instance in ("w1", "w2")
    )
    rebalancing = threading.Event()
    original = CommitOverlap.rebalancing

    def noted_rebalancing(self: CommitOverlap) -> None:
        if self._committing is not None:  # a rebalance callback while polling during the commit
            rebalancing.set()
            original(self)
            probe.note("rebalance callback went on")
        else:
            original(self)

    monkeypatch.setattr(CommitOverlap, "rebalancing", noted_rebalancing)
    handled: list[bytes] = []
    lock = threading.Lock()
    events: list[Event] = []
    done = threading.Event()

    def handle(record: Record) -> bytes:
        with lock:
            handled.append(record.value or b"")
        return b"out-" + (record.value or b"")

    def second_member() -> None:
        with running(second, timeout=30):
            done.wait(60)

    joiner = threading.Thread(target=second_member)

    def rebalance_then_commit() -> None:
        joiner.start()
        _wait(rebalancing, "a rebalance callback")
        probe.note("commit goes on")

    probe.armed, probe.hook = lambda: bool(handled), rebalance_then_commit
    for app in (first, second):
        app.add_listener(handle, src, output=dst, name="h", max_batch_records=5, overlap_commit=True)
    first.on(Event)(events.append)
    more = [f"w{i:02d}".encode() for i in range(20)]
    try:
        with running(first):
            wait_for(rebalancing.is_set, 30, message="the rebalance")
            kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(more)])
            wait_for(
                lambda: kafka.committed(group, src) == {0: 15, 1: 10}, 60, message="everything committed by the group"
            )
    finally:
        done.set()
        joiner.join(60)
    assert first.failure is None and second.failure is None
    assert probe.log.index("commit returned") < probe.log.index("rebalance callback went on"), probe.log
    assert [e for e in events if isinstance(e, PartitionsRevoked)], "the first member gave partitions up"
    expected = sorted([b"out-" + v for v in _values(5)] + [b"out-" + v for v in more])
    assert sorted(kafka.values(dst)) == expected


def test_a_stop_while_the_commit_is_under_way_loses_and_repeats_nothing(
    kafka: KafkaTestKit, probe: _CommitProbe
) -> None:
    src, dst = kafka.topic(partitions=1), kafka.topic(partitions=1)
    waves = _TwoWaves(kafka, src, probe)
    app = _app(kafka)

    def stop() -> None:
        for container in app.containers:
            container.stop()  # returns at once; the loop ends after this commit

    waves.hold_commit(then=stop)
    app.add_listener(waves.handle, src, output=dst, name="h", max_batch_records=5, overlap_commit=True)
    with running(app):
        wait_for(lambda: not any(c.alive for c in app.containers), 30, message="the container stopped")
    assert probe.after("handled ahead") == "commit returned"
    assert kafka.committed(app.group_id, src) == {0: 5}, "the commit went through; nothing handled ahead did"
    assert sorted(kafka.values(dst)) == _outputs(5)

    again = _app(kafka, app.group_id)
    again.add_listener(waves.handle, src, output=dst, name="h", max_batch_records=5, overlap_commit=True)
    with running(again):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 20}, 30, message="the rest committed")
    assert sorted(kafka.values(dst)) == _outputs(20)
    assert all(waves.handled.count(v) == 1 for v in _values(5))


def test_overlap_commit_is_off_by_default_and_refused_where_it_cannot_run(kafka: KafkaTestKit, tmp_path: Path) -> None:
    src, dst = kafka.topic(partitions=1), kafka.topic(partitions=1)
    kafka.produce(src, _values(10))
    app = _app(kafka)
    events: list[Event] = []
    app.add_listener(lambda r: b"out-" + (r.value or b""), src, output=dst, name="h")  # off by default
    app.on(Event)(events.append)
    with running(app):
        wait_for(lambda: kafka.committed(app.group_id, src) == {0: 10}, 30, message="all committed")
        assert [c._overlap for c in app.containers] == [None]
    assert sorted(kafka.values(dst)) == _outputs(10)
    with pytest.raises(InvalidConfigurationError, match="overlap_commit=True cannot go with in_flight=4"):
        _app(kafka).add_listener(lambda r: None, src, in_flight=4, overlap_commit=True)
    with pytest.raises(InvalidConfigurationError, match="overlap_commit=True cannot go with database="):
        _app(kafka).add_listener(lambda r: None, src, database=f"sqlite:///{tmp_path}/a.db", overlap_commit=True)
    off = _app(kafka)
    off.add_listener(lambda r: None, src, database=f"sqlite:///{tmp_path}/b.db", overlap_commit=False)
    assert off.listeners[0].overlap_commit is False
    assert sum(e.records for e in events if isinstance(e, TransactionCommitted)) == 10


def test_partitions_of_one_poll_are_handled_during_each_other_s_commits(kafka: KafkaTestKit) -> None:
    """fencing="partition" (the embedded broker): a poll is one transaction per partition, each handled while the
    one before it commits; every record is handled once and its output committed once."""
    src, dst = kafka.topic(partitions=4), kafka.topic(partitions=1)
    values = [b"p%03d" % i for i in range(400)]
    kafka.produce(src, [{"value": v, "partition": i % 4} for i, v in enumerate(values)])
    app = _app(kafka)
    handled: list[bytes] = []
    app.add_listener(
        lambda r: handled.append(r.value) or b"out-" + (r.value or b""), src, output=dst, name="h", overlap_commit=True
    )
    with running(app):
        wait_for(lambda: sum(kafka.committed(app.group_id, src).values()) == 400, 30, message="all committed")
        overlap = app.containers[0]._overlap
        assert app.listeners[0].fencing == "partition" and overlap.committed_ahead > 0
    assert sorted(kafka.values(dst)) == sorted(b"out-" + v for v in values)
    assert sorted(handled) == sorted(values), "each record handled once"


def test_results_handled_ahead_are_encoded_as_they_are_without_the_overlap(kafka: KafkaTestKit) -> None:
    """Results confluent-kafka would take (str) or refuse (a dict for the serializer) are held already encoded:
    every output reads back as the listener's serializer and str encoding make it, once."""
    src, dst = kafka.topic(partitions=4), kafka.topic(partitions=1)
    values = [b"%03d" % i for i in range(200)]
    kafka.produce(src, [{"value": v, "partition": i % 4} for i, v in enumerate(values)])

    def handle(record: Record) -> Any:
        n = int(record.value or b"0")
        if n % 3 == 0:
            return ("k%d" % n, {"n": n})  # a dict: the serializer's
        if n % 3 == 1:
            return ("k%d" % n, "s%d" % n)  # str: UTF-8 (not the serializer's), straight to confluent-kafka
        return Output({"n": n}, key="k%d" % n, headers={"h": "x"})

    app = _app(kafka)
    app.add_listener(
        handle, src, output=dst, name="h", overlap_commit=True, serializer=lambda v: json.dumps(v).encode()
    )
    with running(app):
        wait_for(lambda: sum(kafka.committed(app.group_id, src).values()) == 200, 30, message="all committed")
        assert app.containers[0]._overlap.committed_ahead > 0
    assert app.failure is None
    expected = sorted(b"s%d" % n if n % 3 == 1 else b'{"n": %d}' % n for n in range(200))
    assert sorted(kafka.values(dst)) == expected
