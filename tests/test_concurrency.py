"""Key-ordered concurrency inside the transaction (in_flight > 1), on a real broker: order, isolation, exactness."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from helpers import POISON_FQCN, PoisonError, make_app

from kafkatx import App, InvalidConfigurationError, Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.testing import KafkaTestKit, running, wait_for

PARTITIONS = 4


class TransientError(Exception):
    """A failure that goes away when the record is retried."""


def _keyed_input(kafka: KafkaTestKit, count: int, keys: int) -> str:
    """``count`` records over ``keys`` keys on a 4-partition topic; values are ``<key>:<seq within key>``."""
    src = kafka.topic(partitions=PARTITIONS)
    seq: Counter[int] = Counter()
    records = []
    for i in range(count):
        key = i % keys
        records.append((b"k%d" % key, b"k%d:%d" % (key, seq[key])))
        seq[key] += 1
    kafka.produce(src, records)
    return src


def _per_key(values: list[bytes | None]) -> dict[bytes, list[int]]:
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for value in values:
        assert value is not None
        key, _, n = value.partition(b":")
        by_key[key].append(int(n))
    return by_key


def _declare(app: App, src: str, out: str, kind: str, seen: list[bytes], **options: Any) -> None:
    """An enriching handler that waits a little (async or on the pool) and returns ``(key, value)``."""
    if kind == "async":

        @app.listener(src, output=out, **options)
        async def enrich(record: Record) -> tuple[bytes | None, bytes | None]:
            await asyncio.sleep(random.random() / 200)
            seen.append(record.value or b"")
            return record.key, record.value

    else:

        @app.listener(src, output=out, **options)
        def enrich_sync(record: Record) -> tuple[bytes | None, bytes | None]:
            time.sleep(random.random() / 200)
            seen.append(record.value or b"")
            return record.key, record.value


@pytest.mark.parametrize("kind", ["async", "pool"])
def test_each_keys_outputs_are_in_input_order_under_in_flight_50(kafka: KafkaTestKit, kind: str) -> None:
    src, out = _keyed_input(kafka, 2000, 50), kafka.topic(partitions=PARTITIONS)
    app, seen = make_app(kafka), []
    _declare(app, src, out, kind, seen, in_flight=50)
    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    values = kafka.values(out)
    assert len(values) == 2000 and len(set(values)) == 2000, "each record's output exactly once"
    for key, numbers in _per_key(values).items():
        assert numbers == list(range(40)), f"{key!r}: outputs out of input order"
    for key, numbers in _per_key(list(seen)).items():
        assert numbers == sorted(numbers), f"{key!r}: handled out of order"


@pytest.mark.parametrize("kind", ["async", "pool"])
def test_a_poison_record_among_concurrent_ones_is_dead_lettered_alone(kafka: KafkaTestKit, kind: str) -> None:
    src, out = _keyed_input(kafka, 600, 30), kafka.topic(partitions=PARTITIONS)
    poison = b"k7:11"
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    lock = threading.Lock()

    def check(record: Record) -> tuple[bytes | None, bytes | None]:
        with lock:
            calls[record.value or b""] += 1
        if record.value == poison:
            raise PoisonError("poison")
        return record.key, record.value

    if kind == "async":

        @app.listener(src, output=out, in_flight=50, max_attempts=2, dlq=True)
        async def handle(record: Record) -> tuple[bytes | None, bytes | None]:
            await asyncio.sleep(0.001)
            return check(record)

    else:
        app.add_listener(check, src, output=out, in_flight=50, max_attempts=2, dlq=True)
    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    values = kafka.values(out)
    assert sorted(values) == sorted({v for v in _all_values(600, 30)} - {poison}), "every other output exactly once"  # type: ignore[type-var]
    (dead,) = kafka.read(src + "-dlt")
    assert dead.value == poison and dead.key == b"k7"
    headers = parse_dead_letter_headers(dead.headers)
    assert headers.attempts == 2 and headers.exception_fqcn == POISON_FQCN, "Spring's headers, as with in_flight=1"
    assert calls[poison] == 2, "counted, retried once, then dead-lettered"
    for key, numbers in _per_key(values).items():
        assert numbers == sorted(numbers), f"{key!r}: outputs out of input order"


def _all_values(count: int, keys: int) -> list[bytes]:
    return [b"k%d:%d" % (i % keys, i // keys) for i in range(count)]


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_a_transient_failure_is_retried_and_its_record_produced_once(kafka: KafkaTestKit, retry: str) -> None:
    src, out = _keyed_input(kafka, 300, 10), kafka.topic(partitions=PARTITIONS)
    app = make_app(kafka)
    attempts: list[int] = []

    @app.listener(src, output=out, in_flight=20, max_attempts=3, dlq=True, retry=retry)
    async def flaky(record: Record) -> tuple[bytes | None, bytes | None]:
        await asyncio.sleep(0.001)
        if record.value == b"k3:5":
            attempts.append(record.attempt)
            if record.attempt == 1:
                raise TransientError("the service hiccuped")
        return record.key, record.value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert attempts == [1, 2]
    assert sorted(kafka.values(out)) == sorted(_all_values(300, 10))  # type: ignore[type-var]
    assert kafka.values(src + "-dlt") == []


@pytest.mark.parametrize("kind", ["async", "pool"])
def test_a_stop_during_in_flight_work_loses_and_duplicates_nothing(kafka: KafkaTestKit, kind: str) -> None:
    src, out = _keyed_input(kafka, 1500, 100), kafka.topic(partitions=PARTITIONS)
    group = make_app(kafka).group_id
    seen: list[bytes] = []
    for run in range(3):  # stopped twice mid-work, then run to the end
        app = App(group, bootstrap_servers=kafka.bootstrap_servers, instance_id="test")
        _declare(app, src, out, kind, seen, in_flight=40, max_batch_records=500)
        with running(app):
            if run < 2:
                wait_for(lambda: len(seen) > 400 * (run + 1), 60, message="some work done")
            else:
                wait_for(lambda: kafka.caught_up(group, src), 60, message="all committed")
    values = kafka.values(out)
    assert sorted(values) == sorted(_all_values(1500, 100)), "exactly once through two stops"  # type: ignore[type-var]
    for key, numbers in _per_key(values).items():
        assert numbers == list(range(15)), f"{key!r}: outputs out of input order"


@pytest.mark.parametrize("in_flight", [1, 10])
def test_a_coroutine_from_a_plain_handler_stops_the_app_and_dead_letters_nothing(
    kafka: KafkaTestKit, in_flight: int
) -> None:
    """Issue 29 item 3: an async def hidden behind a plain function dead-lettered every record."""
    src, out = _keyed_input(kafka, 20, 5), kafka.topic(partitions=PARTITIONS)
    app = make_app(kafka)

    async def enrich(record: Record) -> bytes | None:
        return record.value

    def hidden(record: Record) -> Any:  # a decorator without functools.wraps
        return enrich(record)

    app.add_listener(hidden, src, output=out, dlq=True, in_flight=in_flight)
    app.start()
    try:
        wait_for(lambda: app.failure is not None, 60, message="the App stops")
    finally:
        app.stop(timeout=30)
    assert isinstance(app.failure, InvalidConfigurationError) and "returned a coroutine" in str(app.failure)
    assert kafka.values(out) == [] and kafka.values(src + "-dlt") == [], "nothing produced, nothing dead-lettered"
    assert set(kafka.committed(app.group_id, src).values()) <= {0}, "no record committed"


def test_a_records_failure_count_survives_a_restart_under_in_flight(kafka: KafkaTestKit) -> None:
    """Spring's counts that survive restarts (rollback/durable.py) hold for records handled concurrently."""
    src, out = _keyed_input(kafka, 200, 10), kafka.topic(partitions=PARTITIONS)
    group = make_app(kafka).group_id
    poison = b"k4:7"
    attempts: list[int] = []
    where: list[tuple[int, int]] = []
    for run in range(2):
        app = App(group, bootstrap_servers=kafka.bootstrap_servers, instance_id="test")

        @app.listener(src, output=out, in_flight=10, max_attempts=2, backoff=30.0, dlq=True)
        async def handle(record: Record) -> tuple[bytes | None, bytes | None]:
            await asyncio.sleep(0.001)
            if record.value == poison:
                attempts.append(record.attempt)
                where.append((record.partition, record.offset))
                raise PoisonError("poison")
            return record.key, record.value

        def count_committed() -> bool:
            partition, offset = where[0]
            return kafka.committed(group, src).get(partition) == offset

        with running(app):
            if run == 0:  # its first failure is committed with its count; its 30 s back-off outlasts this run
                wait_for(lambda: attempts == [1] and count_committed(), 60, message="the count committed")
            else:
                wait_for(lambda: kafka.caught_up(group, src), 60, message="all committed")
    assert attempts == [1, 2], "the restarted App went on counting from the committed count"
    assert kafka.values(src + "-dlt") == [poison]
    assert sorted(kafka.values(out)) == sorted(v for v in _all_values(200, 10) if v != poison)  # type: ignore[type-var]
