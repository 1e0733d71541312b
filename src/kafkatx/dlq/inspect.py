"""``kafkatx dlq inspect``: list the records of a dead-letter topic, filtered, without joining a group."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

from kafkatx.dlq._reading import (
    check_config,
    group_offsets,
    read_range,
    resolve_bootstrap_servers,
    tool_consumer,
    topic_partitions,
    watermarks,
)
from kafkatx.dlq.entries import (
    DeadLetterEntry,
    DlqToolError,
    EntryFilter,
    compile_filters,
    entry_from_message,
    matches_all,
)
from kafkatx.dlq.replay import default_replay_group

__all__ = ["inspect_dlq"]


def inspect_dlq(
    bootstrap_servers: str | None,
    topic: str,
    *,
    filters: Iterable[str | EntryFilter] | None = None,
    limit: int | None = None,
    config: Mapping[str, Any] | None = None,
    idle_timeout: float = 30.0,
    replay_group: str | None = None,
) -> list[DeadLetterEntry]:
    """The dead-lettered records of ``topic`` that match every filter, ordered by (partition, offset).

    Reads read_committed from the beginning to the end offsets taken at the
    start; joins no group and commits nothing. ``limit`` keeps the first N
    matches. Works for DLTs written by Spring too (same headers). Entries
    behind the committed offsets of ``replay_group`` (default: the one
    ``kafkatx dlq replay`` uses) are marked ``replayed``.
    """
    servers = resolve_bootstrap_servers(bootstrap_servers)
    if limit is not None and limit < 0:
        raise DlqToolError(f"limit must be >= 0, got {limit}")
    checks = compile_filters(filters)
    cfg = check_config(config)
    # a throwaway group id: librdkafka needs one, but assign() never joins and nothing is committed
    consumer = tool_consumer(servers, f"kafkatx-dlq-inspect-{uuid.uuid4().hex[:12]}", cfg)
    try:
        parts = topic_partitions(consumer, servers, topic)
        marks = watermarks(consumer, topic, parts)
        starts = {p: low for p, (low, _high) in marks.items()}
        stops = {p: high for p, (_low, high) in marks.items()}
        replayed_up_to = group_offsets(servers, replay_group or default_replay_group(topic), topic, parts, cfg)
        found: list[DeadLetterEntry] = []
        for event in read_range(consumer, topic, starts, stops, idle_timeout):
            if event.message is not None:
                entry = entry_from_message(event.message)
                if matches_all(entry, checks):
                    if entry.offset < replayed_up_to.get(entry.partition, -1):
                        entry = dataclasses.replace(entry, replayed=True)
                    found.append(entry)
    finally:
        consumer.close()
    found.sort(key=lambda e: (e.partition, e.offset))
    return found if limit is None else found[:limit]
