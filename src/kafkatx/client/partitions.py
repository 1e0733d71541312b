"""Pausing and resuming partitions that may have been revoked meanwhile.

The retry feed pauses and resumes retry partitions between polls; a rebalance
can take one away in between, and librdkafka then refuses the whole call. Such
a call is not worth an error: the partition's next owner starts it afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from confluent_kafka import TopicPartition

from kafkatx.client.offsets import TP

__all__ = ["partition_list", "quietly", "topic_partitions"]

log = logging.getLogger("kafkatx.container")


def topic_partitions(tps: Iterable[TP]) -> list[TopicPartition]:
    return [TopicPartition(t, p) for t, p in tps]


def partition_list(tps: Iterable[TP]) -> str:
    """``tps`` for a log line: ``topic[p], ...`` in order, or "nothing"."""
    return ", ".join(f"{t}[{p}]" for t, p in sorted(tps)) or "nothing"


def quietly(method: Callable[[list[TopicPartition]], object], tps: Iterable[TP]) -> None:
    """``method`` (a consumer's pause or resume) on ``tps``; a failure (a partition revoked meanwhile) is logged at
    DEBUG only."""
    partitions = topic_partitions(tps)
    try:
        method(partitions)
    except Exception:
        log.debug("pause/resume of partitions %s failed (revoked?)", partitions, exc_info=True)
