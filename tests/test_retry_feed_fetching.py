"""The retry consumer fetches a retry partition about once per record it brings, not in a loop (issue 40).

The embedded broker answers an empty fetch at once (docs/BROKERS.md), so a retry partition left fetching after a
fetch brought records is fetched in a loop until the container's next poll pauses it, each round trip taken from
the main flow's CPU (docs/BENCHMARKS.md). The fetch requests are counted by librdkafka's own statistics of the
retry consumer, at an interval long enough (1 s, against polls every 500 ms) not to hold its fetching back."""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import make_app

import kafkatx.listener.loop.retry_feed as retry_feed
from kafkatx import Record
from kafkatx.listener.loop.retry_feed import feed_fetching
from kafkatx.testing import KafkaTestKit, running, wait_for


class Transient(Exception):
    """A failure worth retrying."""


class _Counted(retry_feed.Consumer):  # type: ignore[misc]
    """The retry consumer (the rebuild's scanner, which reads to partition EOF, is left alone), with the number of
    fetch requests it sent, from its statistics."""

    fetches: list[int] = []

    def __init__(self, config: dict[str, Any]) -> None:
        if not config.get("enable.partition.eof"):
            config = {**config, "statistics.interval.ms": 1000, "stats_cb": self._count}
        super().__init__(config)

    @staticmethod
    def _count(stats: str) -> None:
        brokers = json.loads(stats).get("brokers", {})
        _Counted.fetches.append(sum(b.get("req", {}).get("Fetch", 0) for b in brokers.values()))


def test_the_retry_consumer_fetches_a_few_times_per_record_in_retry_not_in_a_loop(
    kafka: KafkaTestKit, monkeypatch: pytest.MonkeyPatch
) -> None:
    """12 of 24 records fail once (back-off 0.3 s) on an idle listener polling every 500 ms: one fetch request
    (each retry partition is held until its first hop is due, and all of its hops come in one fetch), where the
    retry consumer sent 3,400 to 16,800 when its empty retry partitions were fetched from their committed offsets
    until a poll found them at their end, and after each fetch that brought records."""
    _Counted.fetches = []
    monkeypatch.setattr(retry_feed, "Consumer", _Counted)
    src, out = kafka.topic(partitions=4), kafka.topic(partitions=4)
    kafka.produce(src, [{"key": b"k%d" % i, "value": b"%d" % i, "partition": i % 4} for i in range(24)])
    app = make_app(kafka, create_topics=True)
    attempts: dict[bytes, list[int]] = {}

    @app.listener(
        src,
        output=out,
        max_attempts=3,
        backoff=0.3,
        retry="topics",
        ordering="none",
        max_batch_ms=500,
    )
    def handle(record: Record) -> bytes:
        value = record.value or b""
        attempts.setdefault(value, []).append(record.attempt)
        if int(value) % 2 and record.attempt == 1:
            raise Transient("fails once")
        return value

    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 24, 60, message="every record's output committed")
        seen = len(_Counted.fetches)
        wait_for(lambda: len(_Counted.fetches) >= seen + 3, 10, message="three more statistics")
    assert sorted(r.value for r in kafka.read(out)) == sorted(b"%d" % i for i in range(24)), "each once"
    assert all(attempts[b"%d" % i] == [1, 2] for i in range(1, 24, 2)), attempts
    fetched = max(_Counted.fetches)
    assert fetched < 100, f"{fetched} fetch requests for 12 records in retry: fetched in a loop"


def test_with_debug_logging_the_retry_consumer_keeps_librdkafkas_fetching() -> None:
    """Every op waiting in the retry consumer's queue holds the after-poll fetching back, a log line too: a stream
    of debug lines could hold it back for good, so with ``debug`` set it fetches as librdkafka does by default."""
    assert feed_fetching({"group.id": "g"}) == {"queued.min.messages": 1, "fetch.queue.backoff.ms": 50}
    assert feed_fetching({"group.id": "g", "debug": "fetch"}) == {}
