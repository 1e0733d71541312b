"""``retry="topics"`` seen from outside (issue 40): the records in retry and the oldest due time with
``ordering="none"`` too (rebuilt at assignment from the retry topics, never from memory), the retries handled, and
/readyz while records wait in retry."""

from __future__ import annotations

import threading
import time
from typing import Any

from helpers import make_app
from test_health import get

from kafkatx import App, Record
from kafkatx.events import Event, RecordsInRetry, RetryHandled
from kafkatx.metrics import instrument
from kafkatx.retry_topics.headers import due_ms_of
from kafkatx.testing import KafkaTestKit, running, wait_for

TOPICS: dict[str, Any] = {"retry": "topics", "ordering": "none"}


class Transient(Exception):
    """A failure worth retrying."""


def test_records_in_retry_without_key_order_are_rebuilt_at_a_restart_with_their_oldest_due_time(
    kafka: KafkaTestKit,
) -> None:
    """The first App stops with every record in retry; the second, under the same group, counts them from the retry
    topics before it handles any, with the due time of the one due first, and tells each retry handled."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    values = [b"r-%d" % i for i in range(4)]
    kafka.produce(src, [{"key": b"k%d" % i, "value": v, "partition": i % 2} for i, v in enumerate(values)])

    def handler(record: Record) -> bytes:
        if record.attempt < 2:
            raise Transient("not yet")
        return b"done-" + (record.value or b"")

    first = make_app(kafka, name="retry-count")
    told: list[RecordsInRetry] = []
    first.on(RecordsInRetry)(told.append)
    first.listener(src, output=out, max_attempts=3, backoff=2.0, dlq=True, **TOPICS)(handler)
    with running(first):
        wait_for(lambda: told and told[-1].records == 4, 30, message="four records in retry, committed")
    hops = kafka.read(src + "-retry")
    assert len(hops) == 4
    oldest = min(due_ms_of(hop.headers) for hop in hops) / 1000.0
    assert [e.oldest_due for e in told if e.records == 4] == [oldest]
    assert (told[-1].records, told[-1].oldest_due) == (0, None), "its partitions revoked at the stop: none of its own"

    second = App(first.name, bootstrap_servers=kafka.bootstrap_servers, group_id=first.group_id, instance_id="other")
    metrics = instrument(second)
    seen: list[Event] = []
    second.on(RecordsInRetry)(seen.append)
    second.on(RetryHandled)(seen.append)
    at_first_retry: list[float | None] = []
    lock = threading.Lock()

    def retried(record: Record) -> bytes:
        with lock:
            if not at_first_retry:
                labels = {"app": second.name, "listener": listener}
                value = metrics.registry.get_sample_value("kafkatx_retry_oldest_due_timestamp_seconds", labels)
                at_first_retry.append(value)
        return handler(record)

    listener = "count"
    second.listener(src, name=listener, output=out, max_attempts=3, backoff=2.0, dlq=True, **TOPICS)(retried)
    with running(second):
        wait_for(lambda: len(kafka.read(out)) == 4, 60, message="four outputs")
        wait_for(lambda: _counts(seen)[-1:] == [(0, None)], 30, message="none left in retry")
    first_handled = next(i for i, e in enumerate(seen) if isinstance(e, RetryHandled))
    assert (4, oldest) in _counts(seen[:first_handled]), "rebuilt from the retry topics before any retry was handled"
    assert at_first_retry == [oldest], "the gauge said so before the first retry ran"
    handled = [e.record for e in seen if isinstance(e, RetryHandled) and e.record is not None]
    assert sorted((r.value, r.attempt, r.topic) for r in handled) == [(v, 2, src) for v in values]
    labels = {"app": second.name, "listener": listener}
    assert metrics.registry.get_sample_value("kafkatx_records_in_retry", labels) == 0
    assert metrics.registry.get_sample_value("kafkatx_retries_handled_total", labels) == 4
    assert metrics.registry.get_sample_value("kafkatx_retry_oldest_due_timestamp_seconds", labels) is None, (
        "no sample once none is in retry"
    )


def _counts(events: list[Event]) -> list[tuple[int, float | None]]:
    return [(e.records, e.oldest_due) for e in events if isinstance(e, RecordsInRetry)]


def test_a_listener_with_records_waiting_in_retry_stays_ready(kafka: KafkaTestKit) -> None:
    """Records due in 60 s wait in retry (their partition paused until due) for three times ``not_ready_after``:
    every /readyz answer meanwhile is 200, and a record produced meanwhile is handled: the listener processes."""
    src, out = kafka.topic(partitions=2), kafka.topic(partitions=2)
    kafka.produce(src, [{"value": b"fails-%d" % p, "partition": p} for p in (0, 1)])
    app = make_app(kafka, name="retry-ready", health_port=0, not_ready_after=1.0)
    told: list[RecordsInRetry] = []
    app.on(RecordsInRetry)(told.append)

    @app.listener(src, name="orders", output=out, max_attempts=2, backoff=60.0, dlq=True, **TOPICS)
    def handle(record: Record) -> bytes:
        value = record.value or b""
        if value.startswith(b"fails"):
            raise Transient("later")
        return b"out-" + value

    with running(app):
        assert app.health_server is not None
        url = app.health_server.url + "/readyz"
        wait_for(lambda: told and told[-1].records == 2, 30, message="two records in retry")
        until = time.monotonic() + 3 * app.not_ready_after
        answers = []
        while time.monotonic() < until:
            answers.append(get(url))
        kafka.produce(src, [{"value": b"meanwhile", "partition": 0}])
        wait_for(lambda: [r.value for r in kafka.read(out)] == [b"out-meanwhile"], 30, message="handled meanwhile")
        status, body = get(url)
        assert told[-1].records == 2, "still waiting: due in a minute"
    assert answers and {a[0] for a in answers} == {200}, [a for a in answers if a[0] != 200][:1]
    assert status == 200 and body["listeners"][0].get("reasons", []) == [], body
