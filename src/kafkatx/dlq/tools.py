"""Inspect and replay dead-letter topics (the library behind ``kafkatx dlq``).

Both read the dead-letter topic (DLT) ``read_committed`` and never join a
consumer group, so they can run next to the applications that write it.
:func:`replay_dlq` is exactly-once (:mod:`kafkatx.dlq.replay`). The pieces
live in :mod:`~kafkatx.dlq.entries` (records and filters),
:mod:`~kafkatx.dlq._reading` (the clients), :mod:`~kafkatx.dlq.inspect` and
:mod:`~kafkatx.dlq.replay`; this module gathers the public names.
docs/DLQ.md describes the commands and the policies.
"""

from kafkatx.client.brokers import ENV_BOOTSTRAP
from kafkatx.dlq._reading import resolve_bootstrap_servers
from kafkatx.dlq.entries import (
    FILTER_FIELDS,
    DeadLetterEntry,
    DlqFilter,
    DlqToolError,
    EntryFilter,
    parse_filter,
)
from kafkatx.dlq.inspect import inspect_dlq
from kafkatx.dlq.replay import (
    REPLAYED_FROM,
    RecordHook,
    ReplayResult,
    default_replay_group,
    replay_dlq,
    replay_transactional_id,
    replayed_headers,
)

__all__ = [
    "ENV_BOOTSTRAP",
    "FILTER_FIELDS",
    "REPLAYED_FROM",
    "DeadLetterEntry",
    "DlqFilter",
    "DlqToolError",
    "EntryFilter",
    "RecordHook",
    "ReplayResult",
    "default_replay_group",
    "inspect_dlq",
    "parse_filter",
    "replay_dlq",
    "replay_transactional_id",
    "replayed_headers",
    "resolve_bootstrap_servers",
]
