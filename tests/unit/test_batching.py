"""Deterministic: a batch listener's fill loop never holds the same offset twice (issue 11, item 9).

Eager rebalancing revokes every partition and, when one comes back, the
consumer fetches it again from the committed offset. If that happens between
the extra consume() calls that fill a batch, the records fetched before the
revoke come again: they must not end up in the batch twice.
"""

from __future__ import annotations

from typing import Any

from confluent_kafka import TopicPartition

from kafkatx import App
from kafkatx.listener.loop.container import ListenerContainer
from kafkatx.listener.spec import build_spec


class Msg:
    def __init__(self, partition: int, offset: int) -> None:
        self._p, self._o = partition, offset

    def topic(self) -> str:
        return "in"

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def error(self) -> None:
        return None


class RebalancingConsumer:
    """consume() returns scripted batches; before the second one, partition 0 is revoked and re-assigned."""

    def __init__(self, container: ListenerContainer) -> None:
        self.container = container
        self.calls = 0

    def consume(self, num_messages: int, timeout: float) -> list[Any]:
        self.calls += 1
        if self.calls == 1:
            return [Msg(0, 0), Msg(0, 1), Msg(1, 0)]
        if self.calls == 2:
            partitions = [TopicPartition("in", 0)]
            self.container._on_revoke(self, partitions)  # type: ignore[arg-type]
            self.container._on_assign(self, partitions)  # type: ignore[arg-type]
            return [Msg(0, 0), Msg(0, 1), Msg(0, 2)]  # refetched from the committed offset (0)
        return []

    def resume(self, partitions: list[TopicPartition]) -> None: ...

    def committed(self, partitions: list[TopicPartition], timeout: float) -> list[TopicPartition]:
        return [TopicPartition(p.topic, p.partition, -1001) for p in partitions]


def test_a_partition_revoked_and_reassigned_while_filling_a_batch_is_not_held_twice() -> None:
    app = App("fill", bootstrap_servers="127.0.0.1:9", instance_id="t")
    handled: list[tuple[int, int]] = []

    def runner(container: ListenerContainer) -> Any:
        return lambda unit: handled.extend((m.partition(), m.offset()) for m in unit.messages)

    spec = build_spec(
        lambda df: None, ["in"], {"max_batch_ms": 1000, "max_batch_records": 100}, kind="batch", runner=runner
    )
    container = ListenerContainer(spec, app, 0, 0)
    consumer = RebalancingConsumer(container)
    container.consumer = consumer  # type: ignore[assignment]
    container._group_producer = object()  # type: ignore[assignment]  # never used: the runner commits nothing
    container.assigned.update({("in", 0), ("in", 1)})
    container._poll_and_process()
    assert sorted(handled) == [(0, 0), (0, 1), (0, 2), (1, 0)], handled
