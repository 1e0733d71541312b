"""A listener read to its end on the embedded broker, which answers an empty fetch at once: its partitions wait
paused a moment instead of being fetched in a loop, and a record produced meanwhile is still handled at once
(listener/loop/quiet_partitions.py)."""

from __future__ import annotations

import json
import threading
import time

from helpers import make_app

from kafkatx import Record
from kafkatx.listener.loop.quiet_partitions import QUIET_HOLD_S
from kafkatx.testing import KafkaTestKit, running, wait_for


class FetchCount:
    """The listener consumer's Fetch requests, from librdkafka's statistics (every 100 ms)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, int]] = []
        self._lock = threading.Lock()

    def __call__(self, stats: str) -> None:
        brokers = json.loads(stats).get("brokers", {}).values()
        fetches = sum((broker.get("req") or {}).get("Fetch", 0) for broker in brokers)
        with self._lock:
            self.samples.append((time.monotonic(), fetches))

    def rate_over(self, seconds: float) -> float:
        """Fetches a second over the next ``seconds``."""
        with self._lock:
            start = len(self.samples)
        wait_for(lambda: len(self.samples) > start and self.samples[-1][0] - self.samples[start][0] >= seconds, 30)
        with self._lock:
            (t0, n0), (t1, n1) = self.samples[start], self.samples[-1]
        return (n1 - n0) / (t1 - t0)


def test_a_listener_at_its_end_waits_instead_of_fetching_in_a_loop_and_still_takes_a_new_record_at_once(
    kafka: KafkaTestKit,
) -> None:
    src, out = kafka.topic(partitions=4), kafka.topic()
    fetches = FetchCount()
    app = make_app(kafka, consumer_config={"stats_cb": fetches, "statistics.interval.ms": 100})
    handled: dict[bytes, float] = {}

    @app.listener(src, output=out)
    def echo(record: Record) -> bytes | None:
        assert record.value is not None
        handled[record.value] = time.monotonic()
        return record.value

    kafka.produce(src, [b"first"])
    with running(app):
        wait_for(lambda: len(kafka.read(out)) == 1, 60, message="the first record handled")
        idle_rate = fetches.rate_over(1.0)
        latencies = []
        for i in range(5):
            sent = time.monotonic()
            kafka.produce(src, [b"late-%d" % i])
            wait_for(lambda i=i: b"late-%d" % i in handled, 10, message="a record produced while it was idle")
            latencies.append(handled[b"late-%d" % i] - sent)
    # On the embedded broker a consumer at its end fetched ~40,000 times a second; held, a few thousand at most.
    assert idle_rate < 8000, f"{idle_rate:.0f} fetches/s while idle"
    # What arrives during a hold waits at most the hold (and the poll that takes it), not a poll timeout or more.
    assert sorted(latencies)[2] < QUIET_HOLD_S + 0.25, latencies
    assert sorted(r.value for r in kafka.read(out)) == sorted([b"first"] + [b"late-%d" % i for i in range(5)])
