"""A handler failure undoes that record's work only: the records before it commit once, never run again.

Each case was measured on the batch-rollback model, where one failing record aborted the whole transaction and
its batch-mates were re-run (and, reset to attempt 1, could fail again for ever): a livelock, successes handled
twice in record, typed and ``database=`` listeners, a failed call's ``send()`` produced into an aborted
transaction.
"""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict
from typing import Any

import pytest
import sqlalchemy as sa
from database_helpers import fresh_table, table_rows
from helpers import make_app
from pydantic import BaseModel

from kafkatx import Record, db, send
from kafkatx.events import TransactionAborted
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for


def _produce_numbered(kafka: KafkaTestKit, topic: str, count: int, partitions: int = 1) -> None:
    kafka.produce(topic, [{"value": b"%d" % i, "partition": i % partitions} for i in range(count)])


def _aborts(app: Any) -> list[TransactionAborted]:
    aborted: list[TransactionAborted] = []
    app.on(TransactionAborted)(aborted.append)
    return aborted


def test_a_record_that_needs_three_tries_is_handed_attempts_1_2_3_and_every_output_commits_once(
    kafka: KafkaTestKit,
) -> None:
    """The livelock: every 25th record fails while ``attempt < 3``. It must see attempts 1, 2, 3 exactly, and
    succeed; its success must never be rolled back by the next failing record (which reset its count)."""
    src, out = kafka.topic(), kafka.topic()
    _produce_numbered(kafka, src, 200)
    app = make_app(kafka)
    attempts: dict[int, list[int]] = defaultdict(list)
    calls: Counter[int] = Counter()

    @app.listener(src, output=out, max_attempts=3, backoff=0.2, dlq=True)
    def handle(record: Record) -> bytes:
        n = int(record.value or b"")
        calls[n] += 1
        if n % 25 == 24:
            attempts[n].append(record.attempt)
            if record.attempt < 3:
                raise TimeoutError(f"{n} needs three tries")
        return b"out-%d" % n

    aborted = _aborts(app)
    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all 200 records committed")
    assert dict(attempts) == {n: [1, 2, 3] for n in range(24, 200, 25)}, "attempt numbers only go up"
    assert Counter(kafka.values(out)) == Counter(b"out-%d" % n for n in range(200)), "every output once"
    assert all(calls[n] == 1 for n in range(200) if n % 25 != 24), "a success is never handled twice"
    assert kafka.values(src + "-dlt") == [], "nothing dead-lettered"
    assert aborted == [], "a handler failure aborts nothing"


@pytest.mark.parametrize("backoff", [0, 0.05], ids=["retry-at-once", "back-off"])
@pytest.mark.parametrize("kind", ["plain", "async"])
def test_records_before_a_poison_record_are_handled_once(kafka: KafkaTestKit, backoff: float, kind: str) -> None:
    """1 in 20 records always fails: each good record is handled exactly once, each poison record exactly
    max_attempts times, then dead-lettered in the transaction that commits its offset."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    _produce_numbered(kafka, src, 200, partitions=2)
    app = make_app(kafka)
    calls: Counter[int] = Counter()

    def work(record: Record) -> bytes:
        n = int(record.value or b"")
        calls[n] += 1
        send(out, b"sent-%d" % n)
        if n % 20 == 7:
            raise ValueError(f"poison {n}")
        return b"out-%d" % n

    if kind == "plain":
        app.listener(src, output=out, max_attempts=3, backoff=backoff, dlq=True)(work)
    else:

        @app.listener(src, output=out, max_attempts=3, backoff=backoff, dlq=True, in_flight=4)
        async def handle(record: Record) -> bytes:
            await asyncio.sleep(0)
            return work(record)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    poison = {n for n in range(200) if n % 20 == 7}
    assert {n: c for n, c in calls.items() if n not in poison} == dict.fromkeys(set(range(200)) - poison, 1)
    assert {n: calls[n] for n in poison} == dict.fromkeys(poison, 3)
    good = set(range(200)) - poison
    expected = Counter([b"out-%d" % n for n in good] + [b"sent-%d" % n for n in good])
    assert Counter(kafka.values(out)) == expected, "each good record's outputs once; the poison ones' never"
    assert sorted(int(v or b"") for v in kafka.values(src + "-dlt")) == sorted(poison)


def test_a_failed_calls_send_is_never_produced_not_even_into_an_aborted_transaction(kafka: KafkaTestKit) -> None:
    """What a handler sent before it raised is dropped before it reaches the producer: a read_uncommitted
    reader sees none of it (an aborted transaction's records are visible to it)."""
    src, out = kafka.topic(), kafka.topic()
    _produce_numbered(kafka, src, 30)
    app = make_app(kafka)

    @app.listener(src, max_attempts=2, backoff=0, dlq=True)
    def handle(record: Record) -> None:
        n = int(record.value or b"")
        send(out, b"sent-%d-attempt-%d" % (n, record.attempt))
        if n % 10 == 3:
            raise ValueError("after sending")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all records committed")
    seen = kafka.values(out, isolation="read_uncommitted")
    assert sorted(seen) == sorted(b"sent-%d-attempt-1" % n for n in range(30) if n % 10 != 3), (
        "only the successful calls' sends reach the broker, once"
    )


class Order(BaseModel):
    id: int
    amount: float


def test_undecodable_records_cost_their_batch_mates_nothing(kafka: KafkaTestKit) -> None:
    """1 in 25 records cannot be decoded: it is dead-lettered in the running transaction, without the handler,
    and the decodable records are each handled once."""
    src, out = kafka.topic(), kafka.topic()
    values = [b"not json" if i % 25 == 5 else b'{"id": %d, "amount": 1.5}' % i for i in range(100)]
    kafka.produce(src, [{"value": v} for v in values])
    app = make_app(kafka)
    calls: Counter[int] = Counter()

    @app.listener(src, output=out, value_type=Order, dlq=True)
    def handle(record: Record) -> bytes:
        calls[record.value.id] += 1
        return b"%d" % record.value.id

    aborted = _aborts(app)
    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all records committed")
    decodable = [i for i in range(100) if i % 25 != 5]
    assert calls == Counter(decodable), "each decodable record handled once"
    assert Counter(kafka.values(out)) == Counter(b"%d" % i for i in decodable)
    assert kafka.values(src + "-dlt") == [b"not json"] * 4
    assert aborted == []


def test_a_failed_records_rows_are_rolled_back_alone_and_its_batch_mates_rows_commit_once(
    kafka: KafkaTestKit, pg_engine: sa.Engine
) -> None:
    """With ``database=`` each record runs in a savepoint: the failed record's rows go, the rows of the records
    before it in the same transaction stay and commit with it, and no successful record is handled twice."""
    src, out = kafka.topic(), kafka.topic()
    table = unique_name("rows").replace("-", "_")
    fresh_table(pg_engine, table)
    _produce_numbered(kafka, src, 60)
    app = make_app(kafka)
    calls: Counter[int] = Counter()
    lock = threading.Lock()

    @app.listener(src, output=out, database=pg_engine, max_attempts=2, backoff=0, dlq=True)
    def handle(record: Record) -> bytes:
        n = int(record.value or b"")
        with lock:
            calls[n] += 1
        db().execute(sa.text(f"INSERT INTO {table} (k, v) VALUES (:k, 'x')"), {"k": str(n)})
        if n % 10 == 4:
            raise ValueError(f"poison {n}")
        return b"%d" % n

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    good = [n for n in range(60) if n % 10 != 4]
    assert {n: c for n, c in calls.items() if n % 10 != 4} == dict.fromkeys(good, 1), "no success re-run"
    assert table_rows(pg_engine, table) == Counter(str(n) for n in good), "the poison records' rows are gone"
    assert Counter(kafka.values(out)) == Counter(b"%d" % n for n in good)
