"""The benchmark's delay proxy (bench/kafka_proxy.py): a network between clients and the broker.

Its figures only mean something if the proxy really adds its delay and
loses nothing: a transactional kafkatx App behind it must still be exact.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from confluent_kafka import Producer

from kafkatx import App, Record
from kafkatx.testing import KafkaTestKit, running, unique_name, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from kafka_proxy import KafkaProxy  # noqa: E402

DELAY = 0.02


@pytest.fixture
def proxy(request: pytest.FixtureRequest, kafka: KafkaTestKit) -> Iterator[KafkaProxy]:
    if request.config.getoption("--kafka-bootstrap"):
        pytest.skip("the proxy fronts one broker: the embedded one")
    with KafkaProxy(int(kafka.bootstrap_servers.rsplit(":", 1)[1]), DELAY) as started:
        yield started


def test_every_round_trip_through_the_proxy_pays_its_delay_both_ways(kafka: KafkaTestKit, proxy: KafkaProxy) -> None:
    topic = kafka.topic()
    producer = Producer({"bootstrap.servers": proxy.bootstrap_servers, "linger.ms": 0, "log_level": 3})
    producer.produce(topic, b"warm-up")  # metadata and connection first
    assert producer.flush(30) == 0
    started = time.perf_counter()
    producer.produce(topic, b"timed")
    assert producer.flush(30) == 0
    assert time.perf_counter() - started >= 2 * DELAY, "a produce round trip is faster than the delay each way"


def test_a_transactional_app_behind_the_proxy_stays_exactly_once(kafka: KafkaTestKit, proxy: KafkaProxy) -> None:
    src, out = kafka.topic(partitions=2), kafka.topic()
    app = App(unique_name("proxied"), bootstrap_servers=proxy.bootstrap_servers, instance_id="p")

    @app.listener(src, output=out)
    def handle(record: Record) -> bytes:
        return (record.value or b"").upper()

    values = [b"v%d" % i for i in range(200)]
    with running(app):
        kafka.produce(src, values)
        wait_for(lambda: kafka.caught_up(app.group_id, src), 60, message="all committed")
    assert Counter(kafka.values(out)) == Counter(v.upper() for v in values)
