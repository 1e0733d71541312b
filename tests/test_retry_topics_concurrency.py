"""``retry="topics"`` with records handled concurrently (``in_flight > 1``, an ``async def`` handler): a failed record
hops through the retry topics as with one record at a time, and its key's later records follow it, so each key's
outputs come out in input order, exactly once, while records of other keys run at the same time."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter, defaultdict
from typing import Any

import pytest
from helpers import make_app
from tenacity import wait_exponential

from kafkatx import Record
from kafkatx.dlq.headers import parse_dead_letter_headers
from kafkatx.events import HandlerFailed, OutageStarted, RecordsInRetry
from kafkatx.testing import KafkaTestKit, running, wait_for


class Transient(Exception):
    """A failure worth retrying."""


class _Calls:
    """What the handler saw, from its threads or tasks: attempts per value, the order handled, the most at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.attempts: dict[bytes, list[int]] = defaultdict(list)
        self.handled: list[bytes] = []
        self.now = self.most = 0

    def enter(self, record: Record) -> None:
        with self.lock:
            self.attempts[record.value or b""].append(record.attempt)
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self, value: bytes | None) -> None:
        with self.lock:
            self.now -= 1
            if value is not None:
                self.handled.append(value)


def _by_key(records: list[Any]) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = defaultdict(list)
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        out[r.key or b""].append(r.value or b"")
    return dict(out)


@pytest.mark.parametrize("kind", ["async", "threads"])
def test_concurrent_handlers_retry_through_the_topics_with_each_keys_outputs_in_input_order_exactly_once(
    kafka: KafkaTestKit, kind: str
) -> None:
    """Four keys on two partitions, ``in_flight=4``; some records fail at attempts 1-2 (0.2 s then 0.4 s, two retry
    topics) with later records of their key behind them; each call takes a few milliseconds, so records of
    different keys overlap."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    keys = [b"a", b"b", b"c", b"d"]
    inputs = [{"key": k, "value": b"%s-%d" % (k, i), "partition": n % 2} for i in range(6) for n, k in enumerate(keys)]
    flaky = {b"a-0", b"a-3", b"b-1", b"c-4", b"x-0"}
    kafka.produce(src, [{"value": b"x-0", "partition": 0}, *inputs, {"value": b"x-1", "partition": 0}])
    app = make_app(kafka)
    calls = _Calls()
    in_retry: list[int] = []
    app.on(RecordsInRetry)(lambda event: in_retry.append(event.records))
    options: dict[str, Any] = {
        "output": out,
        "in_flight": 4,
        "max_attempts": 4,
        "backoff": wait_exponential(multiplier=0.2, max=10),
        "dlq": True,
        "retry": "topics",
    }

    def outcome(record: Record) -> tuple[bytes | None, bytes]:
        value = record.value or b""
        if value in flaky and record.attempt < 3:
            raise Transient(f"{value!r} attempt {record.attempt}")
        return record.key, b"out-" + value

    if kind == "async":

        @app.listener(src, **options)
        async def handle(record: Record) -> tuple[bytes | None, bytes]:
            calls.enter(record)
            result = None
            try:
                await asyncio.sleep(0.005)  # a call to a service: other records' calls overlap it
                result = outcome(record)
                return result
            finally:
                calls.leave(result and record.value)

    else:

        @app.listener(src, **options)
        def handle_in_threads(record: Record) -> tuple[bytes | None, bytes]:
            calls.enter(record)
            result = None
            try:
                time.sleep(0.005)  # a blocking call to a service: other records' calls overlap it
                result = outcome(record)
                return result
            finally:
                calls.leave(result and record.value)

    with running(app):
        wait_for(lambda: len(calls.handled) == len(inputs) + 2, 60, message="every record handled")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
        wait_for(lambda: bool(in_retry) and in_retry[-1] == 0, 30, message="no record left in retry")
    assert calls.most > 1, "records were handled concurrently"
    expected = {k: [b"out-%s-%d" % (k, i) for i in range(6)] for k in keys}
    outputs = kafka.read(out)
    assert sorted(r.value or b"" for r in outputs if r.key is None) == [b"out-x-0", b"out-x-1"]
    keyed = [r for r in outputs if r.key is not None]
    assert Counter(r.value for r in keyed) == Counter(v for vs in expected.values() for v in vs), "exactly once"
    assert _by_key(keyed) == expected, "each key's outputs in input order"
    handled = calls.handled
    for k in keys:
        assert [v for v in handled if v.startswith(k)] == [b"%s-%d" % (k, i) for i in range(6)], k
    assert [v for v in handled if v.startswith(b"x")] == [b"x-1", b"x-0"], "no key, no key order"
    attempts = calls.attempts  # each failure settled in its turn: no record's call is made twice
    assert {v: a for v, a in attempts.items() if v in flaky} == dict.fromkeys(flaky, [1, 2, 3])
    assert all(a == [1] for v, a in attempts.items() if v not in flaky), "a follower spends no attempt"
    followed = [
        r.value or b""
        for topic in (src + "-retry-200", src + "-retry-400")
        for r in kafka.read(topic)
        if parse_dead_letter_headers(r.headers).exception_fqcn is None
    ]
    assert {b"a-1", b"b-2", b"c-5"} <= set(followed), "the records behind a failed one followed it"
    assert not any(v.startswith((b"d", b"x")) for v in followed), "no key, or nothing in retry: it never follows"
    assert kafka.read(src + "-dlt") == []


def test_concurrent_handlers_without_key_order_retry_through_the_topics_and_dead_letter_exactly_once(
    kafka: KafkaTestKit,
) -> None:
    """``ordering="none"``: records pass each other; a record that keeps failing is dead-lettered after its last
    attempt, naming its input coordinates; every other output once."""
    src, out = kafka.topic(partitions=2), kafka.topic()
    values = [b"v-%d" % i for i in range(40)]
    kafka.produce(src, [{"key": b"k%d" % (i % 5), "value": v, "partition": i % 2} for i, v in enumerate(values)])
    app = make_app(kafka)
    calls = _Calls()

    @app.listener(src, output=out, in_flight=8, ordering="none", max_attempts=3, backoff=0.2, dlq=True, retry="topics")
    async def handle(record: Record) -> bytes:
        calls.enter(record)
        result = None
        try:
            await asyncio.sleep(0.002)
            if record.value == b"v-7" or (record.value in (b"v-3", b"v-30") and record.attempt == 1):
                raise Transient(f"{record.value!r} attempt {record.attempt}")
            result = b"out-" + (record.value or b"")
            return result
        finally:
            calls.leave(result and record.value)

    with running(app):
        wait_for(lambda: len(kafka.read(src + "-dlt")) == 1, 30, message="the record that keeps failing dead-lettered")
        wait_for(lambda: len(kafka.read(out)) == 39, 30, message="every other record's output")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
    assert Counter(r.value for r in kafka.read(out)) == Counter(b"out-" + v for v in values if v != b"v-7")
    [dead] = kafka.read(src + "-dlt")
    info = parse_dead_letter_headers(dead.headers)
    assert (dead.value, info.original_topic, info.original_partition, info.attempts) == (b"v-7", src, 1, 3)
    attempts = calls.attempts
    assert attempts[b"v-7"] == [1, 2, 3] and attempts[b"v-3"] == attempts[b"v-30"] == [1, 2]


@pytest.mark.parametrize("in_flight", [1, 4])
def test_an_outage_with_records_in_retry_counts_no_attempt_and_loses_or_doubles_nothing(
    kafka: KafkaTestKit, in_flight: int
) -> None:
    """A dependency goes down while a record waits in the retry topic with its key's next record behind it: the
    listener pauses (the outage aborts the transaction and is waited out), no attempt is counted for it, and once
    the dependency is back every output comes out once, each key's in input order."""
    src, out = kafka.topic(), kafka.topic()
    app = make_app(kafka)
    down = threading.Event()
    calls: list[tuple[bytes, int, bool]] = []
    lock = threading.Lock()
    failed: list[HandlerFailed] = []
    started: list[OutageStarted] = []
    app.on(HandlerFailed)(failed.append)
    app.on(OutageStarted)(started.append)

    @app.listener(src, output=out, retry="topics", max_attempts=3, backoff=0.5, dlq=True, in_flight=in_flight)
    def handle(record: Record) -> tuple[bytes | None, bytes]:
        value = record.value or b""
        with lock:
            calls.append((value, record.attempt, down.is_set()))
        if down.is_set():
            raise ConnectionError("the pricing service is unreachable")
        if value == b"a0" and record.attempt == 1:
            raise Transient("a0 attempt 1")
        return record.key, value.upper()

    first = [(b"a", b"a0"), (b"a", b"a1"), (b"b", b"b0"), (b"b", b"b1")]
    later = [(b"c", b"c0"), (b"a", b"a2"), (b"c", b"c1")]
    with running(app):
        kafka.produce(src, [{"key": k, "value": v} for k, v in first])
        wait_for(lambda: len(kafka.read(src + "-retry")) == 2, 30, message="a0 in retry, a1 behind it")
        down.set()
        kafka.produce(src, [{"key": k, "value": v} for k, v in later])
        wait_for(lambda: sum(1 for _, _, was_down in calls if was_down) >= 3, 30, message="retried during the outage")
        down.clear()
        wait_for(lambda: len(kafka.read(out)) == 7, 60, message="every output after the outage")
        wait_for(lambda: kafka.caught_up(app.group_id, src), 30, message="every input offset committed")
    outputs = kafka.read(out)
    assert Counter(r.value for r in outputs) == Counter(v.upper() for _, v in first + later), "each output once"
    assert [r.value for r in outputs if r.key == b"a"] == [b"A0", b"A1", b"A2"], "key a in input order"
    assert [(e.record.value if e.record else None, e.attempt) for e in failed] == [(b"a0", 1)], "the outage counted"
    assert len(started) == 1
    assert [a for v, a, was_down in calls if v == b"a0" and not was_down] == [1, 2]
    assert kafka.read(src + "-dlt") == []
