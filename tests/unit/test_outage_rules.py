"""Dependency outages over a fake host: no attempt counted, the whole listener waits, one retry at a time (no broker)."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import TopicPartition
from fakes import FakeHost, listener, messages

from kafkatx import App, DependencyUnavailable, InvalidConfigurationError, OutageTooLongError, Record
from kafkatx.events import HandlerFailed, OutageEnded, OutageStarted, RecordRecovered
from kafkatx.listener.failure.outage import MAX_RETRY_DELAY, ListenerOutage, OutageHold, first_delay, is_outage
from kafkatx.listener.failure.reactions import KafkaErrorReactions
from kafkatx.record import ConsumedMessage

IN = ("in", 0)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _outage(clock: Clock, **options: Any) -> tuple[ListenerOutage, list[Any]]:
    events: list[Any] = []
    return ListenerOutage("orders", events.append, first_delay=1.0, clock=clock, **options), events


def _record(offset: int, partition: int = 0) -> Record:
    return Record("in", partition, offset, None, b"v", attempt=1)


# -- what counts as an outage -------------------------------------------------------------------------------------
def test_connection_errors_and_dependency_unavailable_are_outages_along_the_cause_chain() -> None:
    class ServiceDown(Exception):
        pass

    try:
        try:
            raise ConnectionRefusedError("refused")
        except ConnectionRefusedError as low:
            raise ServiceDown("payments") from low
    except ServiceDown as exc:
        wrapped = exc
    assert is_outage(wrapped, (ConnectionError,)), "a cause down the chain counts"
    assert is_outage(DependencyUnavailable("cache down"), ()), "the public exception always counts"
    assert not is_outage(ValueError("bad record"), (ConnectionError,))
    assert not is_outage(ConnectionError("down"), ()), "outages=() turns the default off"


def test_the_options_are_checked_when_the_listener_is_declared() -> None:
    assert listener(lambda r: None).outages == (ConnectionError,)
    assert listener(lambda r: None, outages=TimeoutError).outages == (TimeoutError,)
    with pytest.raises(InvalidConfigurationError, match="outages must be exception classes"):
        listener(lambda r: None, outages=["ConnectionError"])
    with pytest.raises(InvalidConfigurationError, match="max_outage must be a number of seconds"):
        listener(lambda r: None, max_outage=0)


def test_the_first_wait_is_the_listeners_back_off_or_half_a_second() -> None:
    assert first_delay(listener(lambda r: None, backoff=2.0).policy) == 2.0
    assert first_delay(listener(lambda r: None).policy) == 1.0, "the default back-off, 1 s"
    assert first_delay(listener(lambda r: None, backoff=0).policy) == 0.5


# -- a handler whose dependency is down -----------------------------------------------------------------------------
def _down(record: Record) -> bytes:
    if record.value == b"b":
        raise ConnectionError("payments API unreachable")
    return record.value or b""


def test_an_outage_counts_no_attempt_calls_no_recoverer_and_rewinds_the_unit() -> None:
    recovered: list[Record] = []
    host = FakeHost(listener(_down, max_attempts=1, dlq=lambda r, e: recovered.append(r)))
    batch = messages(b"a", b"b", b"c")
    host.runner()(host.unit(batch))
    assert recovered == [] and host.events_of(RecordRecovered) == [], "never reaches the recoverer"
    assert host.events_of(HandlerFailed) == [], "not a failed attempt"
    assert host.tracker.attempt("in", 0, 1) == 1, "its attempt did not move"
    assert [t.outcome for t in host.producer.transactions] == ["aborted"], "nothing committed"
    assert host.seeks == [(IN, 0)], "the unit is fetched again from its first record"
    (started,) = host.events_of(OutageStarted)
    assert started.record.offset == 1 and isinstance(started.exception, ConnectionError)
    assert host.outage.active and host.outage.admits(0, {IN}) == frozenset(), "the listener waits"


def test_the_same_failure_is_an_ordinary_one_when_outages_is_empty() -> None:
    recovered: list[Record] = []
    host = FakeHost(listener(_down, max_attempts=1, outages=(), dlq=lambda r, e: recovered.append(r)))
    host.runner()(host.unit(messages(b"a", b"b", b"c")))
    assert [r.offset for r in recovered] == [1]
    assert not host.outage.active and host.events_of(OutageStarted) == []


def test_after_the_outage_the_record_is_handled_at_the_attempt_it_had() -> None:
    calls: list[tuple[int, int]] = []
    down = [True]

    def handler(record: Record) -> bytes:
        calls.append((record.offset, record.attempt))
        if down[0]:
            raise DependencyUnavailable("inventory service is down")
        return record.value or b""

    clock = Clock()
    host = FakeHost(listener(handler, max_attempts=2))
    host.outage = ListenerOutage(host.name, host.publish, first_delay=1.0, clock=clock)
    batch = messages(b"a", b"b")
    host.runner()(host.unit(batch))
    clock.now += 1.0
    assert host.outage.admits(0, {IN}) == frozenset([IN]), "its retry is due"
    down[0] = False
    host.runner()(host.unit(batch))
    assert calls == [(0, 1), (0, 1), (1, 1)]
    assert host.producer.committed_values == [b"a", b"b"], "each output once"
    (ended,) = host.events_of(OutageEnded)
    assert ended.seconds == 1.0 and ended.retries == 0
    assert host.outage.admits(0, {IN}) is None, "the listener resumed"


# -- the shared state: who handles what, and when ----------------------------------------------------------------------
def test_every_container_waits_and_only_the_records_owner_retries_its_partition() -> None:
    clock = Clock()
    outage, events = _outage(clock)
    assert outage.admits(0, {IN}) is None and outage.admits(1, {("in", 1)}) is None
    assert outage.report(0, ConnectionError("down"), _record(5)) == 1.0
    assert [type(e) for e in events] == [OutageStarted]
    assert outage.admits(0, {IN, ("in", 2)}) == frozenset() and outage.admits(1, {("in", 1)}) == frozenset()
    clock.now += 1.0
    assert outage.admits(0, {IN, ("in", 2)}) == frozenset([IN]), "the record's partition alone"
    assert outage.admits(1, {("in", 1)}) == frozenset(), "the other containers stay paused"


def test_the_wait_doubles_after_each_failed_retry_up_to_the_cap() -> None:
    clock = Clock()
    outage, _ = _outage(clock)
    waits = [outage.report(0, ConnectionError("down"), _record(5))]
    assert outage.report(1, ConnectionError("down"), _record(9, 1)) == 1.0, "a report during the wait: no growth"
    for _ in range(8):
        clock.now += waits[-1]
        waits.append(outage.report(0, ConnectionError("down"), _record(5)))
    assert waits == [1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert MAX_RETRY_DELAY == 2.0, "back within about 2 s of the dependency returning, however long it was down"


def test_a_listener_back_off_longer_than_the_cap_is_the_wait() -> None:
    clock = Clock()
    outage = ListenerOutage("l", lambda event: None, first_delay=5.0, clock=clock)
    waits = [outage.report(0, ConnectionError("down"), _record(5))]
    for _ in range(3):
        clock.now += waits[-1]
        waits.append(outage.report(0, ConnectionError("down"), _record(5)))
    assert waits == [5.0, 5.0, 5.0, 5.0]


def test_only_a_commit_past_the_waiting_record_after_the_wait_ends_the_outage() -> None:
    clock = Clock()
    outage, events = _outage(clock)
    outage.report(0, ConnectionError("down"), _record(5))
    outage.committed({IN: 9})
    assert outage.active, "a transaction under way when the outage started says nothing"
    clock.now += 1.5
    outage.committed({IN: 5})
    assert outage.active, "records before it went through, not it"
    outage.committed({IN: 6})
    assert not outage.active
    assert [type(e) for e in events] == [OutageStarted, OutageEnded] and events[1].seconds == 1.5


def test_when_the_records_partition_moves_every_container_retries() -> None:
    clock = Clock()
    outage, _ = _outage(clock)
    outage.report(0, ConnectionError("down"), _record(5))
    clock.now += 1.0
    assert outage.admits(0, {("in", 3)}) is None, "revoked meanwhile: nothing to wait for in particular"
    assert outage.admits(1, {("in", 1)}) is None
    outage.committed({("in", 1): 4})
    assert not outage.active


def test_an_outage_longer_than_max_outage_stops_with_a_clear_message() -> None:
    clock = Clock()
    outage, _ = _outage(clock, max_outage=10.0)
    outage.report(0, ConnectionError("payments API unreachable"), _record(5))
    clock.now += 10.0
    outage.admits(0, {IN})
    clock.now += 0.5
    with pytest.raises(OutageTooLongError, match=r"unavailable for 10s, longer than max_outage=10s .*ConnectionError"):
        outage.admits(1, {("in", 1)})


def test_an_operators_pause_holds_the_listener_until_resumed() -> None:
    outage, _ = _outage(Clock())
    outage.pause()
    assert outage.paused and outage.admits(0, {IN}) == frozenset()
    outage.resume()
    assert not outage.paused and outage.admits(0, {IN}) is None


def test_app_pause_names_a_listener() -> None:
    app = App("outages-unit", bootstrap_servers="localhost:1")

    @app.listener("in", name="orders")
    def handle(record: Record) -> None:
        return None

    app.pause("orders")
    assert app._outage_of("orders").paused
    app.resume("orders")
    assert not app._outage_of("orders").paused
    with pytest.raises(InvalidConfigurationError, match="no listener named 'order'.*'orders'"):
        app.pause("order")


# -- one container's consumer ------------------------------------------------------------------------------------------
class PausingConsumer:
    """The consumer calls the hold makes: pause, resume and a poll that returns what a test queued."""

    def __init__(self) -> None:
        self.paused: set[tuple[str, int]] = set()
        self.fetched: list[ConsumedMessage] = []

    def pause(self, partitions: list[TopicPartition]) -> None:
        self.paused.update((p.topic, p.partition) for p in partitions)

    def resume(self, partitions: list[TopicPartition]) -> None:
        self.paused.difference_update((p.topic, p.partition) for p in partitions)

    def consume(self, num_messages: int, timeout: float) -> list[ConsumedMessage]:
        out, self.fetched = self.fetched, []
        return out


def test_the_hold_pauses_the_containers_partitions_and_seeks_back_what_was_fetched() -> None:
    clock = Clock()
    host = FakeHost(listener(lambda r: None))
    host.assigned = {IN, ("in", 1)}
    consumer = PausingConsumer()
    host.consumer = consumer  # type: ignore[assignment]
    host.outage = outage = ListenerOutage(host.name, host.publish, first_delay=1.0, clock=clock)
    handled: list[list[ConsumedMessage]] = []
    hold = OutageHold(host, KafkaErrorReactions(host).consumer_error)
    assert not hold.poll(handled.append), "no outage: the container polls as usual"
    outage.report(0, ConnectionError("down"), _record(5))
    consumer.fetched = messages(b"x", b"y", start=7)
    host.polled_at = 0.0
    assert hold.poll(handled.append)
    assert consumer.paused == {IN, ("in", 1)} and handled == []
    assert host.polled_at > 0.0, "the held poll is noted on the container (mark_polled): /livez sees it polling"
    assert host.seeks == [(IN, 7)], "fetched before the pause: they come again after it"
    clock.now += 1.0
    consumer.fetched = messages(b"w", start=5)
    assert hold.poll(handled.append)
    assert consumer.paused == {("in", 1)}, "the waiting record's partition alone is retried"
    assert [[m.offset() for m in batch] for batch in handled] == [[5]]
    outage.committed({IN: 6})
    assert not hold.poll(handled.append) and consumer.paused == set(), "the whole container resumes"


def test_kafkatx_run_exits_non_zero_and_says_why_when_an_outage_outlasts_max_outage(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from kafkatx.cli.run import _failed

    clock = Clock()
    outage, _ = _outage(clock, max_outage=5.0)
    outage.report(0, ConnectionError("cache cluster unreachable"), _record(5))
    clock.now += 6.0
    with pytest.raises(OutageTooLongError) as stopped:
        outage.admits(0, {IN})
    assert _failed(stopped.value, None, argparse.Namespace()) == 1
    err = capsys.readouterr().err
    assert "max_outage=5s" in err and "cache cluster unreachable" in err and "delivered again on restart" in err


def test_one_line_when_it_starts_a_reminder_every_minute_and_one_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    outage, _ = _outage(clock)
    with caplog.at_level("INFO", logger="kafkatx.outage"):
        outage.report(0, ConnectionError("payments API unreachable"), _record(5))
        for _ in range(130):  # two minutes of polls, one a second, and a failed retry each time it is due
            clock.now += 1.0
            if outage.admits(0, {IN}):
                outage.report(0, ConnectionError("payments API unreachable"), _record(5))
        clock.now += MAX_RETRY_DELAY  # its retry is due, and passes
        outage.committed({IN: 6})
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(lines) == 4, lines
    assert "a dependency is unavailable (ConnectionError: payments API unreachable) while handling in/0@5" in lines[0]
    assert "still paused" in lines[1] and "for 60s" in lines[1] and "still paused" in lines[2]
    assert "available again after" in lines[3]
