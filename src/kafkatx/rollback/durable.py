"""Failure state that travels with the committed offset, so attempt counts survive restarts and crashes.

Every transaction kafkatx commits stores, as offset-commit metadata of each
partition, a :class:`PartitionState` about the record at the committed
offset:

- ``failures``: how many of its attempts failed (an exception, or the
  process dying while it was being handled);
- ``inflight``: records from this offset were handed to the handler and are
  not finished. A normal commit sets it for the next batch, which is about to
  start; a clean stop clears it again;
- ``inflight_until``: where the range in flight ends (exclusive), when it is
  less than a batch: while a crash is being looked for
  (:mod:`kafkatx.rollback.bisection`). Without it, the claim is of a batch:
  at most ``max_batch_records`` records from ``offset``;
- ``careful_until``: written when the range in flight is one record (it is
  then ``offset + 1``), so that a version from before ``inflight_until``
  reads the same claim the same way;
- ``owner``: the process that wrote an ``inflight`` claim (a token made at
  its start). A claim found by the same, living process is its own, left
  when it lost the partition (a rebalance, a broker restart): no crash.

Whoever owns the partition next (after a restart, a rebalance, in another
process) reads it back with the committed offset. An ``inflight`` flag still
set means the previous owner died while handling the claimed range: if it
is one record, that record failed once more; if it is several, kafkatx looks
for the one that kills the process by bisection over them, each half handled
in one transaction whose claim names that half, and the record found is
counted. After ``max_attempts`` it is recovered (dead-lettered) without
calling the handler, so a record that crashes the process (a native library
fault, ``os._exit``, the OOM killer) cannot stop a partition forever.

The metadata is a short JSON object behind a ``kafkatx:`` prefix, well under
Kafka's ``offset.metadata.max.bytes`` (4096); foreign or malformed metadata
is ignored, and so are keys this version does not know (an earlier version
reads a claim of several records as a batch claim).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

__all__ = ["PartitionState", "encode", "encode_inflight", "inflight_claim_parts", "decode", "process_token"]

_PREFIX = "kafkatx:"
_token: tuple[int, str] = (-1, "")


def process_token() -> str:
    """A token of this process (made again after a fork): who wrote an in-flight claim."""
    global _token
    pid = os.getpid()
    if _token[0] != pid:
        _token = (pid, os.urandom(6).hex())
    return _token[1]


@dataclass(frozen=True, slots=True)
class PartitionState:
    """What a committed offset says about the record at that offset."""

    offset: int
    failures: int = 0
    inflight: bool = False
    careful_until: int | None = None
    owner: str | None = None
    inflight_until: int | None = None


def encode_inflight(offset: int, owner: str) -> str:
    """``encode(PartitionState(offset, inflight=True, owner=owner))``, the claim of almost every commit (a batch
    from ``offset``), without json.dumps (``owner`` is a hex token)."""
    head, tail = inflight_claim_parts(owner)
    return f"{head}{int(offset)}{tail}"


def inflight_claim_parts(owner: str) -> tuple[str, str]:
    """What :func:`encode_inflight` writes before and after the offset of ``owner``'s claim: a commit's claim is
    ``f"{head}{offset}{tail}"``, with no call per commit."""
    return f'{_PREFIX}{{"offset":', f',"inflight":true,"owner":"{owner}"}}'


def encode(state: PartitionState) -> str:
    data: dict[str, object] = {"offset": state.offset}
    if state.failures:
        data["failures"] = state.failures
    if state.inflight:
        data["inflight"] = True
    if state.careful_until is not None:
        data["careful_until"] = state.careful_until
    if state.owner is not None:
        data["owner"] = state.owner
    if state.inflight_until is not None:
        data["inflight_until"] = state.inflight_until
    return _PREFIX + json.dumps(data, separators=(",", ":"))


def decode(metadata: str | None, offset: int) -> PartitionState | None:
    """The state stored with committed ``offset``, or None (none, foreign, or about another offset)."""
    if not metadata or not metadata.startswith(_PREFIX):
        return None
    try:
        data = json.loads(metadata[len(_PREFIX) :])
        state = PartitionState(
            int(data["offset"]),
            int(data.get("failures", 0)),
            bool(data.get("inflight", False)),
            None if data.get("careful_until") is None else int(data["careful_until"]),
            None if data.get("owner") is None else str(data["owner"]),
            None if data.get("inflight_until") is None else int(data["inflight_until"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if state.offset != offset or state.offset < 0 or state.failures < 0:
        return None
    return state
