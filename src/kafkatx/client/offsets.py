"""Where each partition's records start and end in a batch: what rewinds and offset commits are made of."""

from __future__ import annotations

from collections.abc import Sequence

from kafkatx.record import ConsumedMessage

__all__ = ["TP", "first_offsets", "next_offsets"]

#: A topic-partition, as (topic, partition).
TP = tuple[str, int]


def first_offsets(msgs: Sequence[ConsumedMessage]) -> dict[TP, int]:
    """The first offset of each partition in ``msgs``."""
    first: dict[TP, int] = {}
    for m in msgs:
        first.setdefault((m.topic(), m.partition()), m.offset())
    return first


def next_offsets(msgs: Sequence[ConsumedMessage]) -> dict[TP, int]:
    """The offset after the last record of each partition in ``msgs``."""
    offsets: dict[TP, int] = {}
    for m in msgs:
        tp = (m.topic(), m.partition())
        offset = m.offset() + 1
        if offset > offsets.get(tp, -1):
            offsets[tp] = offset
    return offsets
