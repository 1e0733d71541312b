"""Batch listeners (issue 41): a list of records in, outputs out, in one transaction; a named failed record settled
alone; poison records isolated by halves (the Spark listener's search), only they dead-lettered."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter, defaultdict
from typing import Any

import pytest
from helpers import PoisonError, make_app
from pydantic import BaseModel

import kafkatx
from kafkatx import InvalidConfigurationError, Record, send
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.testing import KafkaTestKit, running, wait_for


def _produce_numbered(kafka: KafkaTestKit, topic: str, count: int, partitions: int = 1) -> None:
    kafka.produce(topic, [{"value": b"%d" % i, "partition": i % partitions} for i in range(count)])


def _number(record: Record) -> int:
    return int(record.value or b"")


@pytest.mark.parametrize("kind", ["def", "async def"])
def test_a_batch_handlers_outputs_commit_exactly_once_with_batches_of_many_records(
    kafka: KafkaTestKit, kind: str
) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic()
    _produce_numbered(kafka, src, 300, partitions=2)
    app = make_app(kafka)
    sizes: list[int] = []

    def work(records: list[Record]) -> list[bytes]:
        sizes.append(len(records))
        for r in records:
            send(out, b"sent-%d" % _number(r))
        return [b"out-%d" % _number(r) for r in records]

    if kind == "def":
        app.batch_listener(src, output=out, max_batch_records=100, max_batch_ms=500)(work)
    else:

        @app.batch_listener(src, output=out, max_batch_records=100, max_batch_ms=500)
        async def handle(records: list[Record]) -> list[bytes]:
            await asyncio.sleep(0)
            return work(records)

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all 300 records committed")
    assert max(sizes) > 1, f"the handler got batches, not single records: {sizes}"
    assert sum(sizes) == 300, "each record handed to the handler once"
    expected = Counter([b"out-%d" % n for n in range(300)] + [b"sent-%d" % n for n in range(300)])
    assert Counter(kafka.values(out)) == expected, "every returned and sent output exactly once"


def test_records_a_handler_keeps_are_never_changed_by_later_batches(kafka: KafkaTestKit) -> None:
    """The runner refills an earlier batch's records for the next one (no allocation per record): only those
    nothing else holds. A handler keeping whole lists, single records or none sees every kept one as it was."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    _produce_numbered(kafka, src, 400, partitions=2)
    app = make_app(kafka)
    kept: list[tuple[Record, tuple[int, int, bytes | None]]] = []
    calls = 0

    @app.batch_listener(src, output=out, max_batch_records=25, max_batch_ms=500)
    def handle(records: list[Record]) -> list[bytes]:
        nonlocal calls
        calls += 1
        if calls % 3 == 0:  # every third batch kept whole, the others' first record only
            kept.extend((r, (r.partition, r.offset, r.value)) for r in records)
        elif calls % 3 == 1:
            kept.append((records[0], (records[0].partition, records[0].offset, records[0].value)))
        return [r.value or b"" for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all 400 records committed")
    assert calls > 6, f"many batches, so that later ones had records to refill: {calls}"
    changed = [(seen, (r.partition, r.offset, r.value)) for r, seen in kept if (r.partition, r.offset, r.value) != seen]
    assert changed == [], "a kept record was refilled for a later batch"
    assert Counter(kafka.values(out)) == Counter(b"%d" % n for n in range(400))


def test_a_named_failed_record_is_retried_alone_and_its_batch_mates_commit_once(kafka: KafkaTestKit) -> None:
    """RecordFailedError on the record 13: the records before it get a call of their own and commit once (never
    run again); 13 is retried alone with attempts 2 and 3, then dead-lettered; the records after it once."""
    src, out = kafka.topic(), kafka.topic()
    _produce_numbered(kafka, src, 40)
    app = make_app(kafka)
    calls: list[list[tuple[int, int]]] = []
    returned: Counter[int] = Counter()
    outputs_of: Counter[int] = Counter()

    @app.batch_listener(src, output=out, max_attempts=3, backoff=0.2, dlq=True, max_batch_records=40, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        calls.append([(_number(r), r.attempt) for r in records])
        results = []
        for r in records:
            if _number(r) == 13:
                try:
                    raise PoisonError("thirteen")
                except PoisonError as err:
                    raise kafkatx.RecordFailedError(r) from err
            results.append(b"out-%d" % _number(r))
        returned.update(_number(r) for r in records)
        return results

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    given = Counter(n for call in calls for n, _ in call)
    attempts_of_13 = [a for call in calls for n, a in call if n == 13]
    assert attempts_of_13 == [1, 2, 3], f"13's own attempts go up: {calls}"
    assert [c for c in calls if c and c[0][0] == 13] == [[(13, 2)], [(13, 3)]], "13 retried alone"
    assert returned == Counter(n for n in range(40) if n != 13), "every other record in one call that returned"
    assert all(given[n] == 2 for n in range(40) if n != 13), (
        f"the others were given twice: the call that failed on 13, and theirs; never re-run after it: {calls}"
    )
    outputs_of.update(int(v.split(b"-")[1]) for v in kafka.values(out))
    assert outputs_of == Counter(n for n in range(40) if n != 13), "every other record's output exactly once"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"13"]
    info = parse_dead_letter_headers(dead[0].headers)
    assert info.exception_fqcn is not None and info.exception_fqcn.endswith("PoisonError"), "judged on the cause"
    assert info.attempts == 3


def test_a_named_record_that_succeeds_on_its_retry_is_not_dead_lettered(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    _produce_numbered(kafka, src, 20)
    app = make_app(kafka)
    seen: dict[int, list[int]] = defaultdict(list)

    @app.batch_listener(src, output=out, max_attempts=3, backoff=0, dlq=True, max_batch_records=20, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        for r in records:
            seen[_number(r)].append(r.attempt)
            if _number(r) == 5 and r.attempt < 2:
                raise kafkatx.RecordFailedError(r) from TimeoutError("once")
        return [b"%d" % _number(r) for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    assert seen[5] == [1, 2]
    assert Counter(kafka.values(out)) == Counter(b"%d" % n for n in range(20))
    assert kafka.values(src + "-dlt") == []


@pytest.mark.parametrize("partitions", [1, 3])
def test_a_poison_record_among_many_is_isolated_and_only_it_is_dead_lettered(
    kafka: KafkaTestKit, partitions: int
) -> None:
    """A plain exception fails the whole call: retried max_attempts times, then the batch is searched by halves;
    only the poison record is dead-lettered, every other record's outputs commit exactly once (no probe's)."""
    src, out = kafka.topic(partitions=partitions), kafka.topic()
    _produce_numbered(kafka, src, 200, partitions=partitions)
    app = make_app(kafka)
    sizes: list[int] = []
    lock = threading.Lock()

    @app.batch_listener(src, output=out, max_attempts=2, backoff=0, dlq=True, max_batch_records=200, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        with lock:
            sizes.append(len(records))
        for r in records:
            send(out, b"sent-%d" % _number(r))
        if any(_number(r) == 77 for r in records):
            raise PoisonError("77 is poison")
        return [b"out-%d" % _number(r) for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    assert max(sizes) > 1
    good = [n for n in range(200) if n != 77]
    expected = Counter([b"out-%d" % n for n in good] + [b"sent-%d" % n for n in good])
    assert Counter(kafka.values(out, isolation="read_uncommitted")) == expected, "no half-batch output, no probe's"
    dead = kafka.read(src + "-dlt")
    assert [d.value for d in dead] == [b"77"]
    assert parse_dead_letter_headers(dead[0].headers).exception_fqcn.endswith("PoisonError")  # type: ignore[union-attr]


class Order(BaseModel):
    id: int
    amount: float


def test_undecodable_records_are_dead_lettered_before_the_handler_sees_the_batch(kafka: KafkaTestKit) -> None:
    src, out = kafka.topic(), kafka.topic()
    values = [b"not json" if i % 10 == 3 else b'{"id": %d, "amount": 1.5}' % i for i in range(50)]
    kafka.produce(src, [{"value": v} for v in values])
    app = make_app(kafka)
    seen: Counter[int] = Counter()
    sizes: list[int] = []

    @app.batch_listener(src, output=out, value_type=Order, dlq=True, max_batch_records=50, max_batch_ms=1000)
    def handle(records: list[Record]) -> list[bytes]:
        sizes.append(len(records))
        assert all(isinstance(r.value, Order) for r in records)
        seen.update(r.value.id for r in records)
        return [b"%d" % r.value.id for r in records]

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all records committed")
    decodable = [i for i in range(50) if i % 10 != 3]
    assert seen == Counter(decodable), "the handler never saw an undecodable record, and each other once"
    assert max(sizes) > 1
    assert Counter(kafka.values(out)) == Counter(b"%d" % i for i in decodable)
    assert kafka.values(src + "-dlt") == [b"not json"] * 5


def _handler(records: list[Record]) -> None:
    return None


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"in_flight": 4}, "does not take 'in_flight'"),
        ({"after_rollback": object()}, "does not take 'after_rollback'"),
        ({"retry": "in_place"}, "does not take 'retry'"),
        ({"max_atempts": 3}, "did you mean 'max_attempts'"),
        ({"max_bisect_job": 3}, "did you mean 'max_bisect_jobs'"),
        ({"max_bisect_jobs": -1}, "max_bisect_jobs must be an integer >= 0"),
    ],
)
def test_an_option_that_does_not_apply_or_is_misspelt_is_refused_naming_it(
    kafka: KafkaTestKit, options: dict[str, Any], message: str
) -> None:
    app = make_app(kafka)
    with pytest.raises(InvalidConfigurationError, match=message):
        app.batch_listener("in", **options)(_handler)
    with pytest.raises(InvalidConfigurationError, match=message):
        app.add_batch_listener(_handler, "in", **options)
    assert app.listeners == []
