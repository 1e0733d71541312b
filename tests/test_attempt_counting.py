"""How failures are counted against a record: the attempt a handler sees, when the count goes on, and per container.

Found against Spring Kafka's expectations (issue 11) and in the bounce tests (issue 17).
"""

from __future__ import annotations

import threading
from collections import Counter, defaultdict

from helpers import PoisonError, make_app

from kafkatx import Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import HandlerFailed
from kafkatx.testing import KafkaTestKit, running, wait_for


class MateError(Exception):
    pass


class BaseFailure(Exception):
    pass


class SubFailure(BaseFailure):
    pass


def test_the_attempt_a_handler_sees_is_the_attempt_the_decision_uses(kafka: KafkaTestKit) -> None:
    """11.2 / 17.1: every failure is counted against the attempt number the handler was given,
    batch-mates re-run in the after-rollback transaction included."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"x", b"p"])
    app = make_app(kafka)
    calls: Counter[bytes] = Counter()
    seen: dict[tuple[bytes, int], int] = {}  # (value, call number) -> the attempt the handler was given
    failed: list[tuple[bytes, int]] = []
    app.on(HandlerFailed)(lambda e: failed.append((e.record.value or b"", e.attempt)))

    @app.listener(src, output=out, max_attempts=3, dlq=True, backoff=0)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        calls[value] += 1
        seen[(value, calls[value])] = record.attempt
        if value == b"p" or (value == b"x" and calls[value] in (1, 2, 4)):
            raise PoisonError(f"{value!r} call {calls[value]}")
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    handler_attempts = [seen[(v, n)] for v, n in sorted(seen) if (v == b"x" and n in (1, 2, 4)) or v == b"p"]
    assert sorted(handler_attempts) == sorted(a for _v, a in failed), (seen, failed)
    dead = {d.value: parse_dead_letter_headers(d.headers).attempts for d in kafka.read(src + "-dlt")}
    assert dead[b"p"] == 3
    x_attempts = [seen[(b"x", n)] for n in range(1, calls[b"x"] + 1)]
    expected, failures_since_success = [], 0
    for n in range(1, calls[b"x"] + 1):
        expected.append(failures_since_success + 1)
        failures_since_success = failures_since_success + 1 if n in (1, 2, 4) else 0
    assert x_attempts == expected, "a success ends the count (issue 28): its next failure is attempt 1 again"
    if b"x" in dead:
        assert dead[b"x"] == max(x_attempts), "dead-lettered at the attempt the handler was told"


def test_a_record_that_fails_once_beside_a_poison_record_sees_1_then_2_and_commits(kafka: KafkaTestKit) -> None:
    """17.1: attempt numbers did go 1, 2, 1, 2, 1, 3 on replay, and the record was dead-lettered.

    Since issue 39 a success commits whatever its batch-mates do: it is never re-run."""
    src, out = kafka.topic(), kafka.topic()
    kafka.produce(src, [b"flaky", b"poison"])
    app = make_app(kafka)
    flaky: list[int] = []

    @app.listener(src, output=out, max_attempts=3, dlq=True, backoff=0)
    def handle(record: Record) -> bytes:
        if record.value == b"poison":
            raise PoisonError("always")
        flaky.append(record.attempt)
        if len(flaky) == 1:
            raise MateError("only the first delivery fails")
        return b"ok"

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert flaky == [1, 2], "failed at 1, succeeded at 2 and committed, never re-run beside the poison record"
    assert kafka.values(out) == [b"ok"], "committed once"
    assert [d.value for d in kafka.read(src + "-dlt")] == [b"poison"]


def test_a_more_general_exception_keeps_counting_as_in_spring(kafka: KafkaTestKit) -> None:
    """11.3: Spring resets the count only when the previous root cause is not an instance of the new one's class."""
    src = kafka.topic()
    kafka.produce(src, [b"p"])
    app = make_app(kafka)
    raises = [SubFailure, BaseFailure, BaseFailure, BaseFailure, BaseFailure]
    calls: list[int] = []

    @app.listener(src, max_attempts=3, dlq=True, backoff=0)
    def handle(record: Record) -> None:
        calls.append(record.attempt)
        raise raises[len(calls) - 1]("x")

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="all committed")
    assert calls == [1, 2, 3], "SubFailure then BaseFailure: the same kind, so three attempts"


def test_two_containers_retry_and_dead_letter_independently(kafka: KafkaTestKit) -> None:
    """Concurrency >= 2 (issue 11): each container counts its own records; poison is dead-lettered once, the rest once."""
    src, out = kafka.topic(partitions=4), kafka.topic()
    records = [{"value": b"p%d" % i if i % 25 == 0 else b"v%d" % i, "partition": i % 4} for i in range(200)]
    kafka.produce(src, records)
    app = make_app(kafka)
    attempts: dict[bytes, list[int]] = defaultdict(list)
    threads: set[str] = set()

    @app.listener(src, output=out, concurrency=2, max_attempts=2, dlq=True, backoff=0)
    def handle(record: Record) -> bytes:
        threads.add(threading.current_thread().name)
        value = record.value or b""
        if value.startswith(b"p"):
            attempts[value].append(record.attempt)
            raise PoisonError(value.decode())
        return value

    with running(app):
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    poison = sorted(r["value"] for r in records if r["value"].startswith(b"p"))  # type: ignore[union-attr]
    assert sorted(d.value for d in kafka.read(src + "-dlt")) == poison
    assert all(a == [1, 2] for a in attempts.values()), attempts
    assert Counter(kafka.values(out)) == Counter(r["value"] for r in records if not r["value"].startswith(b"p"))  # type: ignore[union-attr]
