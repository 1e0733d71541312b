"""Consumer errors polled while a listener is held for a dependency outage get the main loop's reaction.

While a dependency is down, the container polls through its :class:`~kafkatx.listener.failure.outage.OutageHold`
instead of its main loop. An error librdkafka reports meanwhile (another process taking the consumer's
instance id, a missing input topic, an ACL, a fatal client) is reported once: it must stop the container
as it would outside an outage, and a retriable one must be logged, not dropped.
"""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError, Message, Producer, TopicPartition
from unit.fakes import FakeHost, listener, messages  # the unit tests' fake container host

from kafkatx import App, InvalidConfigurationError, KafkaTxError, Record
from kafkatx.events import ContainerStopped, OutageStarted
from kafkatx.listener.failure.outage import OutageHold
from kafkatx.listener.failure.reactions import KafkaErrorReactions
from kafkatx.record import ConsumedMessage
from kafkatx.testing import unique_name, wait_for
from kafkatx.testing.mock_cluster import ApiKey, MockCluster

E = KafkaError
IN = ("in", 0)
TP = tuple[str, int]
Polled = list[Message | ConsumedMessage]  # what one consume() returns


class HeldConsumer:
    """The consumer calls an OutageHold makes; each ``consume`` returns the next poll a test queued."""

    def __init__(self, *polls: Polled) -> None:
        self.polls = list(polls)
        self.paused: set[TP] = set()

    def consume(self, num_messages: int = 1, timeout: float = -1) -> Polled:
        return self.polls.pop(0) if self.polls else []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)


def _down(record: Record) -> bytes:
    raise ConnectionError("payments API unreachable")


def _held(*polls: Polled) -> tuple[FakeHost, OutageHold, list[list[ConsumedMessage]]]:
    """A host whose listener waits out an outage its handler started, polling ``polls`` through its hold."""
    host = FakeHost(listener(_down, backoff=60.0))  # no retry falls due during a test
    host.runner()(host.unit(messages(b"a")))
    assert host.outage.active and host.outage.admits(0, {IN}) == frozenset(), "the listener is held"
    host.consumer = HeldConsumer(*polls)  # type: ignore[assignment]
    host.seeks.clear()
    return host, OutageHold(host, KafkaErrorReactions(host).consumer_error), []


def _error(code: int, reason: str = "", *, fatal: bool = False, topic: str | None = "in") -> Message:
    error = KafkaError(code, reason, fatal=fatal) if reason else KafkaError(code)
    return Message(topic=topic, partition=0, error=error) if topic is not None else Message(error=error)


_INSTANCE_TAKEN = (
    "Fatal error: Broker: Static consumer fenced by other consumer with same group.instance.id: "
    "Fatal consumer error: Broker: Static consumer fenced by other consumer with same group.instance.id"
)


@pytest.mark.parametrize(
    ("error", "kind", "says"),
    [
        # What librdkafka reports once when another live consumer takes this one's group.instance.id.
        (_error(E._FATAL, _INSTANCE_TAKEN, topic=None), InvalidConfigurationError, "another live process uses"),
        (_error(E._UNKNOWN_TOPIC), InvalidConfigurationError, "input topic 'in' does not exist"),
        (_error(E.TOPIC_AUTHORIZATION_FAILED), InvalidConfigurationError, "TOPIC_AUTHORIZATION_FAILED in consume"),
        (_error(E._FATAL, "consumer is fatal", fatal=True), KafkaTxError, "_FATAL in consume: consumer is fatal"),
    ],
    ids=["instance-id-taken", "unknown-topic", "topic-acl", "fatal"],
)
def test_a_consumer_error_that_ends_the_container_ends_it_during_an_outage_too(
    error: Message, kind: type[Exception], says: str
) -> None:
    host, hold, handled = _held([error, *messages(b"a", b"b")])
    with pytest.raises(kind) as raised:
        hold.poll(handled.append)
    assert says in str(raised.value)
    with pytest.raises(kind) as main_loop:  # the main loop's reaction to the same error
        host.error_reactions.consumer_error(error)
    assert type(raised.value) is type(main_loop.value) and str(raised.value) == str(main_loop.value)
    assert handled == [], "records polled with a fatal error were handled"


def test_a_retriable_consumer_error_during_an_outage_is_logged_once_with_its_code(
    caplog: pytest.LogCaptureFixture,
) -> None:
    polled: Polled = [_error(E._TRANSPORT, "broker down"), *messages(b"a", b"b", start=1)]
    host, hold, handled = _held(polled, [])
    caplog.clear()  # (the outage's own warning)
    with caplog.at_level(logging.WARNING, logger="kafkatx"):
        assert hold.poll(handled.append), "the hold polled"
        assert hold.poll(handled.append)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == [f"listener {host.name}: consumer error _TRANSPORT: broker down (librdkafka retries)"]
    assert host.outage.active, "the listener still waits for its dependency"
    assert handled == [] and host.seeks == [(IN, 1)], "the records polled with it come again after the outage"


def test_an_end_of_partition_during_an_outage_is_no_error(caplog: pytest.LogCaptureFixture) -> None:
    host, hold, handled = _held([_error(E._PARTITION_EOF)])
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kafkatx"):
        assert hold.poll(handled.append)
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert host.outage.active and handled == []


# -- a running App on librdkafka's mock cluster -------------------------------------------------------------------
@pytest.mark.timeout(90)
def test_another_process_taking_the_instance_id_during_an_outage_stops_the_app_with_a_clear_error() -> None:
    with MockCluster() as mc:
        src = mc.create_topic(unique_name("in"))
        app = App(
            unique_name("held"),
            bootstrap_servers=mc.bootstrap_servers,
            instance_id="pod-1",
            config={"log_level": 2},
            consumer_config={"heartbeat.interval.ms": 300, "fetch.wait.max.ms": 10},
        )
        started: list[OutageStarted] = []
        stopped: list[ContainerStopped] = []
        app.on(OutageStarted)(started.append)
        app.on(ContainerStopped)(stopped.append)
        app.add_listener(_down, src, name="payments")
        producer = Producer({"bootstrap.servers": mc.bootstrap_servers, "log_level": 2})
        producer.produce(src, b"x")
        assert producer.flush(10) == 0, "input not delivered"
        app.start()
        try:
            wait_for(lambda: started or app.failure, 60, message="the outage started")
            assert started, f"the App stopped before the outage: {app.failure!r}"
            # The group coordinator answers a heartbeat as it does once another member took the instance id.
            mc.push_request_errors(ApiKey.HEARTBEAT, *[E.FENCED_INSTANCE_ID] * 3)
            assert app.wait(20), "the App went on after another process took its instance id"
        finally:
            app.stop(timeout=10)
    failure = app.failure
    assert isinstance(failure, InvalidConfigurationError), repr(failure)
    assert "another live process uses group.instance.id 'pod-1-payments-0'" in str(failure)
    assert [(e.reason, e.error) for e in stopped] == [("config", failure)]
