"""Where a container fetches from next: the one rewind, and what of a poll is handled.

Every path that gives records back to be fetched again (an abort, a claim that
did not commit, records handled ahead and given up, a pause that came after
the fetch) seeks each of their partitions to its first record through
:func:`rewind`; both places that poll (the main loop and the outage hold) sort
a poll through :func:`records_to_handle`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Protocol, cast

from confluent_kafka import Message

from kafkatx.client.offsets import TP, first_offsets
from kafkatx.record import ConsumedMessage

__all__ = ["Seeks", "records_to_handle", "rewind"]


class Seeks(Protocol):
    """What can move a partition's fetch position (the container, a transaction unit)."""

    def seek(self, tp: TP, offset: int) -> None: ...


def rewind(host: Seeks, messages: Sequence[ConsumedMessage], at: Mapping[TP, int] | None = None) -> None:
    """Fetch ``messages`` again: each of their partitions sought back to its first record, or to the offset
    ``at`` gives for it."""
    for tp, offset in first_offsets(messages).items():
        host.seek(tp, offset if at is None else at.get(tp, offset))


def records_to_handle(
    host: Seeks,
    polled: list[Message],
    report_error: Callable[[Message], None],
    paused: Collection[TP],
    admitted: Collection[TP] | None = None,
) -> list[ConsumedMessage]:
    """What of a poll is handled: its errors reported first (before anything is handled or sought); records of
    ``paused`` partitions (fetched before the pause took effect) and, with ``admitted``, of partitions not
    admitted, sought back so that they come again after it."""
    # Narrowed once here: a Message without an error always has a topic, partition and offset.
    batch = cast("list[ConsumedMessage]", [m for m in polled if m.error() is None])
    if len(batch) != len(polled):
        for m in polled:
            if m.error() is not None:
                report_error(m)
    if not paused and admitted is None:
        return batch
    keep = _unpaused(batch, paused, admitted)
    if len(keep) != len(batch):
        kept = {id(m) for m in keep}
        rewind(host, [m for m in batch if id(m) not in kept])
    return keep


def _unpaused(
    batch: list[ConsumedMessage], paused: Collection[TP], admitted: Collection[TP] | None
) -> list[ConsumedMessage]:
    """The records of ``batch`` whose partition is not ``paused`` (and is ``admitted``). A poll's records come in
    runs of one partition, and a partition is mostly paused while others flow (a retry partition waiting for its
    head's due time, a partition holding a back-off), so each run is looked up once: two getters per record."""
    keep: list[ConsumedMessage] = []
    append = keep.append
    run_topic, run_partition, run_kept = None, -1, True
    for m in batch:
        partition = m.partition()
        if partition != run_partition or m.topic() != run_topic:
            run_topic, run_partition = m.topic(), partition
            tp = (run_topic, partition)
            run_kept = tp not in paused and (admitted is None or tp in admitted)
        if run_kept:
            append(m)
    return keep
