"""fencing="partition" on the real broker: a poll is one transaction per partition, and their commits overlap.

Each partition has its own transactional producer, so while one partition's commit waits for the broker, the
next partition's records are handled (and committed) in that partition's own transaction. The tests hold a
commit in ``commit_transaction`` (a probe subclass of confluent-kafka's Producer) until another partition's
record was handled meanwhile: without the overlap nothing is handled before the commit returns, and the probe's
wait fails the test. Outputs are read back read_committed: each exactly once.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from confluent_kafka import Producer

import kafkatx.producer as producer_module
from kafkatx import App, Record
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

pytestmark = pytest.mark.timeout(90)

_WAIT = 10.0  # seconds a held commit waits for another partition's record to be handled
#: The first poll waits this long (at most 500 ms) for records: every partition's, produced before the start.
_GATHER_MS = 2000


class _Handled:
    """The records handled, in order, and a probe that holds the first commit of handled records until a record
    of another partition is handled after the committing partition's last one."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self.values: list[bytes] = []
        self.order: list[int] = []  # the partition of each record handled, in order
        self.attempts: dict[bytes, list[int]] = {}
        self.held_once = False
        self.seen_meanwhile = False

    def note(self, record: Record) -> None:
        with self.changed:
            value = record.value or b""
            self.values.append(value)
            self.order.append(record.partition)
            self.attempts.setdefault(value, []).append(record.attempt)
            self.changed.notify_all()

    def hold(self, partition: int) -> None:
        """In commit_transaction of ``partition``'s producer: the first commit of the partition handled first waits
        for a record of another partition handled after that partition's last one (its transaction's).

        Only the first partition's: the next partitions' transactions run inside its commit, and one of them may
        reach commit_transaction first (while the first one's offsets are still being sent); held, it would wait
        for a record that only comes once it returned (the last slice's, or one cut at a failed record)."""
        with self.changed:
            if self.held_once or not self.order or partition != self.order[0]:
                return
            self.held_once = True
            last = len(self.order) - 1 - self.order[::-1].index(partition)
            self.seen_meanwhile = self.changed.wait_for(
                lambda: any(p != partition for p in self.order[last + 1 :]), _WAIT
            )


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Handled]:
    seen = _Handled()

    class ProbedProducer(Producer):  # type: ignore[misc]
        def __init__(self, config: dict[str, Any]) -> None:
            super().__init__(config)
            # fencing="partition": the transactional.id ends with ".<topic>.<partition>" (docs/RESTARTS.md)
            tail = str(config.get("transactional.id", "")).rsplit(".", 1)[-1]
            self.partition = int(tail) if tail.isdigit() else -1

        def commit_transaction(self, *args: Any) -> None:
            seen.hold(self.partition)
            super().commit_transaction(*args)

    monkeypatch.setattr(producer_module, "Producer", ProbedProducer)
    yield seen


def _app(kafka: KafkaTestKit) -> App:
    return App(
        unique_name("turns"),
        bootstrap_servers=kafka.bootstrap_servers,
        instance_id="w1",
        transaction_timeout_ms=60_000,  # the commit deadline outlasts the probe's wait
        config={"log_level": 2},
    )


def test_another_partition_is_handled_and_committed_while_one_commits(kafka: KafkaTestKit, handled: _Handled) -> None:
    src, dst = kafka.topic(partitions=4), kafka.topic(partitions=1)
    values = [b"p%03d" % i for i in range(400)]
    kafka.produce(src, [{"value": v, "partition": i % 4} for i, v in enumerate(values)])
    app = _app(kafka)

    def handle(record: Record) -> bytes:
        handled.note(record)
        return b"out-" + (record.value or b"")

    app.add_listener(handle, src, output=dst, name="h", fencing="partition", max_batch_ms=_GATHER_MS)
    with running(app):
        wait_for(lambda: sum(kafka.committed(app.group_id, src).values()) == 400, 30, message="all committed")
    assert app.failure is None
    assert handled.held_once and handled.seen_meanwhile, "a partition's records were handled during another's commit"
    assert sorted(kafka.values(dst)) == sorted(b"out-" + v for v in values), "each output committed once"
    assert sorted(handled.values) == sorted(values), "each record handled once"


def test_a_record_failing_in_a_turn_taken_during_a_commit_is_settled_in_its_partition(
    kafka: KafkaTestKit, handled: _Handled
) -> None:
    """A record of another partition fails (and is held for its back-off) while the first commit waits: the
    transaction under way still commits its records, the failed one is retried once, nothing is lost or doubled."""
    src, dst = kafka.topic(partitions=2), kafka.topic(partitions=1)
    values = [b"q%03d" % i for i in range(100)]
    kafka.produce(src, [{"value": v, "partition": i % 2} for i, v in enumerate(values)])
    app = _app(kafka)
    flaky = {b"q011", b"q051"}  # partition 1's

    def handle(record: Record) -> bytes:
        handled.note(record)
        if record.value in flaky and record.attempt == 1:
            raise ValueError("try again")
        return b"out-" + (record.value or b"")

    app.add_listener(
        handle, src, output=dst, name="h", fencing="partition", max_attempts=3, backoff=0.2, max_batch_ms=_GATHER_MS
    )
    with running(app):
        wait_for(lambda: sum(kafka.committed(app.group_id, src).values()) == 100, 30, message="all committed")
    assert app.failure is None
    assert handled.held_once and handled.seen_meanwhile, "a partition's records were handled during another's commit"
    assert Counter(kafka.values(dst)) == Counter(b"out-" + v for v in values), "each output committed once"
    assert {v: a for v, a in handled.attempts.items() if a != [1]} == {v: [1, 2] for v in flaky}
