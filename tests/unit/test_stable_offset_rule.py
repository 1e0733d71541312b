"""The stuck rule of the last stable offset check (kafkatx.health.stable_offsets), through a fake watermark source:
stuck once the LSO stays below the high watermark past the threshold, released once it moves; no broker."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pytest

from kafkatx import App
from kafkatx.events import Event, LastStableOffsetReleased, LastStableOffsetStuck
from kafkatx.health.stable_offsets import STUCK_MARGIN_S, StableOffsetWatch, written_topics

TP = tuple[str, int]


class FakeWatermarks:
    """``(last stable offset, high watermark)`` per partition, as the test sets them."""

    def __init__(self) -> None:
        self.marks: dict[TP, tuple[int, int]] = {}
        self.asked: list[list[str]] = []

    def watermarks(self, topics: Sequence[str]) -> dict[TP, tuple[int, int]]:
        self.asked.append(list(topics))
        return {tp: m for tp, m in self.marks.items() if tp[0] in topics}

    def close(self) -> None:
        pass


def _watch(threshold: float | None = 10.0) -> tuple[StableOffsetWatch, list[Event], dict[TP, float | None]]:
    events: list[Event] = []
    gauge: dict[TP, float | None] = {}
    watch = StableOffsetWatch(events.append, threshold=threshold)
    watch.add_sink(lambda listeners, topic, partition, seconds: gauge.__setitem__((topic, partition), seconds))
    watch.reset({"out": ("enrich",), "out-dlt": ("enrich",)}, transaction_timeout_ms=30_000)
    return watch, events, gauge


def test_a_partition_whose_lso_stays_below_the_high_watermark_past_the_threshold_is_stuck_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch, events, gauge = _watch(threshold=10.0)
    source = FakeWatermarks()
    source.marks = {("out", 0): (5, 9), ("out", 1): (7, 7)}
    assert watch.check(source, now=100.0) == []
    assert gauge == {("out", 0): 0.0, ("out", 1): 0.0}
    source.marks[("out", 0)] = (5, 12)  # the App commits behind the open transaction: the watermark grows
    assert watch.check(source, now=110.0) == [], "10 s is not past the threshold of 10 s"
    assert gauge[("out", 0)] == 0.0, "0 while it is within the threshold: a live transaction may be that long"
    with caplog.at_level(logging.WARNING, logger="kafkatx.health"):
        [stuck] = watch.check(source, now=110.5)
        watch.check(source, now=125.0)
    assert stuck.kind == "stuck" and (stuck.topic, stuck.partition, stuck.last_stable_offset) == ("out", 0, 5)
    assert events == [LastStableOffsetStuck("enrich", 0, "out", 0, 5, 12, 10.5)], "one event per episode"
    assert gauge == {("out", 0): 25.0, ("out", 1): 0.0}, "seconds since the LSO was first seen there"
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "out[0]" in warning and "last stable offset has stayed at 5" in warning and "high watermark 12" in warning
    assert "kafkatx transactions abort module:app" in warning
    assert "kafka-transactions.sh" in warning and "abort --topic out --partition 0 --start-offset 5" in warning
    [partition] = watch.stuck()
    assert (partition.topic, partition.partition, partition.last_stable_offset, partition.listeners) == (
        "out",
        0,
        5,
        ("enrich",),
    )

    source.marks[("out", 0)] = (13, 13)  # aborted: the marker, and the LSO catches up
    [released] = watch.check(source, now=130.0)
    assert released.kind == "released"
    assert events[-1] == LastStableOffsetReleased("enrich", 0, "out", 0, 13, 13, 30.0)
    assert gauge[("out", 0)] == 0.0 and watch.stuck() == []


def test_an_lso_that_moves_is_never_stuck_and_an_idle_partition_neither() -> None:
    watch, events, gauge = _watch(threshold=10.0)
    source = FakeWatermarks()
    for step in range(20):  # busy: always a transaction open, but each check finds the LSO further on
        source.marks = {("out", 0): (step * 10, step * 10 + 4), ("out-dlt", 0): (3, 3)}  # the DLT: idle, caught up
        watch.check(source, now=step * 5.0)
    assert events == [] and set(gauge.values()) == {0.0}


def test_a_new_open_transaction_after_a_release_is_a_new_episode() -> None:
    watch, events, _ = _watch(threshold=10.0)
    source = FakeWatermarks()
    source.marks = {("out", 0): (5, 9)}
    for now in (0.0, 11.0):
        watch.check(source, now=now)
    source.marks = {("out", 0): (9, 15)}  # released, and another transaction open at once
    for now in (20.0, 25.0, 30.0):
        watch.check(source, now=now)
    assert [type(e).__name__ for e in events] == ["LastStableOffsetStuck", "LastStableOffsetReleased"]
    watch.check(source, now=30.5)
    assert [type(e).__name__ for e in events][-1] == "LastStableOffsetStuck"
    assert events[-1] == LastStableOffsetStuck("enrich", 0, "out", 0, 9, 15, 10.5)


def test_the_threshold_is_the_transaction_timeout_plus_the_margin_unless_set() -> None:
    watch = StableOffsetWatch(lambda event: None)
    watch.reset({"out": ("a",)}, transaction_timeout_ms=45_000)
    source = FakeWatermarks()
    source.marks = {("out", 0): (1, 2)}
    watch.check(source, now=0.0)
    assert watch.check(source, now=45.0 + STUCK_MARGIN_S) == []
    assert [t.kind for t in watch.check(source, now=45.0 + STUCK_MARGIN_S + 0.1)] == ["stuck"]


def test_the_written_topics_are_the_outputs_send_targets_and_dead_letter_topics() -> None:
    app = App("orders", bootstrap_servers="localhost:1")
    app.add_listener(lambda r: None, "in", name="a", output="out", sends_to=["audit"], dlq=True)
    app.add_listener(lambda r: None, "in2", "in3", name="b", output="out", dlq="parked")
    app.add_listener(lambda r: None, "in4", name="c", dlq=lambda record, exc: None)  # a function: no topic
    assert written_topics(app.listeners) == {
        "out": ("a", "b"),
        "audit": ("a",),
        "in-dlt": ("a",),
        "parked": ("b",),
    }


@pytest.mark.parametrize(
    ("cluster_id", "hinted"),
    [("kafkatx-local-Vhc9bnYESYGWZh4QTqGWFw", True), ("MkU3OEVBNTctOEUyRi00", True), ("prod-kafka-1", False)],
)
def test_on_the_embedded_broker_the_warning_says_that_restarting_it_ends_what_its_restart_left_open(
    caplog: pytest.LogCaptureFixture, cluster_id: str, hinted: bool
) -> None:
    """Issue 42, item 13: after a restart of the embedded broker neither way out of the warning works (docs/BROKERS.md,
    'A transaction open across a broker restart can hang'); the cluster id the check reads says which broker it is."""
    watch, _, _ = _watch(threshold=10.0)
    source = FakeWatermarks()
    source.cluster_id = cluster_id  # type: ignore[attr-defined]  # what KafkaWatermarks reads from the metadata
    source.marks = {("out", 0): (5, 9)}
    with caplog.at_level(logging.WARNING, logger="kafkatx.health"):
        watch.check(source, now=100.0)
        watch.check(source, now=111.0)
    [warning] = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "kafkatx transactions abort module:app" in warning, "the usual ways out are still named"
    assert ("restart the embedded broker once more" in warning) is hinted, warning
