"""A container with no partition says why, the usual cause first and with the numbers it can get (no broker)."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import listener

from kafkatx.listener.loop.brokers import BrokerWatch
from kafkatx.listener.loop.health import UnassignedWatch, no_partition_hint


class MetadataConsumer:
    """confluent-kafka's ``list_topics`` for topics of known partition counts; others are unknown to it."""

    def __init__(self, **partitions: int) -> None:
        self.partitions = partitions

    def list_topics(self, topic: str, timeout: float) -> Any:
        if topic not in self.partitions:
            raise RuntimeError("Local: Broker transport failure")
        meta = SimpleNamespace(error=None, partitions=dict.fromkeys(range(self.partitions[topic])))
        return SimpleNamespace(topics={topic: meta})


def _warning(consumer: Any, concurrency: int, caplog: pytest.LogCaptureFixture) -> str:
    spec = listener(lambda r: None, concurrency=concurrency)
    container: Any = SimpleNamespace(
        name="handle#1", spec=spec, consumer=consumer, group_id="billing", brokers=BrokerWatch("handle#1", 1, "b:9092")
    )
    watch = UnassignedWatch(container, {"session.timeout.ms": 10_000})
    with caplog.at_level(logging.WARNING, logger="kafkatx.container"):
        watch.maybe_warn(time.monotonic() + 3600)  # well past the grace, without waiting for it
    (record,) = caplog.records
    return record.getMessage()


def test_more_consumers_here_than_partitions_is_named_first_with_both_numbers(caplog: pytest.LogCaptureFixture) -> None:
    message = _warning(MetadataConsumer(**{"in": 1}), 2, caplog)
    hint = message.split("(group 'billing'). ", 1)[1]
    assert hint.startswith(
        "Most likely the group has more consumers than partitions: in has 1 partition, and this process alone "
        "runs 2 consumers for the listener (concurrency=2 > 1 partition)."
    ), hint
    assert hint.index("more consumers") < hint.index("instance id") < hint.index("embedded broker")


def test_with_enough_partitions_here_the_other_members_of_the_group_are_named() -> None:
    hint = no_partition_hint({"in": 3, "audit": 1}, 2)
    assert hint.startswith(
        "Most likely the group has more consumers than partitions: in has 3 partitions, audit has 1 partition, "
        "and this process alone runs 2 consumers for the listener; members of the group in other processes count too."
    ), hint


def test_without_metadata_the_usual_cause_still_comes_first(caplog: pytest.LogCaptureFixture) -> None:
    message = _warning(MetadataConsumer(), 1, caplog)
    hint = message.split("(group 'billing'). ", 1)[1]
    assert hint.startswith("Most likely the group has more consumers than the topic has partitions"), hint
    assert "runs 1 consumer for the listener" in hint and "instance id" in hint
