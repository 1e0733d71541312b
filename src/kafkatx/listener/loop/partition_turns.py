"""``fencing="partition"``: each partition's slice of a poll is its own transaction, and their commits overlap.

With one transactional producer per input partition (KIP-98's fencing, what
``fencing="auto"`` picks on a broker without KIP-447), a poll over four
partitions is four transactions. Committed one after another, the
container waits for four commits per poll where ``fencing="group"`` waits
for one. But each partition has its own producer: while one partition's
commit is under way (``commit_transaction`` waits for the broker on the
producer's helper thread, :mod:`kafkatx.client.bounded`), the container
thread begins the next partition's transaction on that partition's producer,
runs its handlers and starts its commit, and so on, up to
:data:`MAX_COMMITS_UNDER_WAY` commits at once.

Nothing is handled ahead of its own partition's commit: a partition's records
are handled in its own transaction, after the previous transaction of that
partition committed (each slice of one poll is a different partition), as
when the slices go one after another. Only the wait for another partition's
commit is shared. Each transaction keeps every reaction of its own (an
abortable error re-runs its work, a fenced producer is replaced, a handler's
failure is settled in it); what would stop the container is raised once the
commit under way returned, and no further slice is started.

Not used with ``database=`` (one database transaction at a time) or the
overlapped commit (``overlap_commit=True``, which holds the next records'
outputs instead), nor by a batch or Spark runner: their slices run one after
another (:func:`partition_stage` picks).
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from kafkatx.client.offsets import TP
from kafkatx.listener.loop.overlap import CommitOverlap
from kafkatx.listener.runners.record_runner import RecordRunner
from kafkatx.listener.transaction.unit import TransactionUnit
from kafkatx.record import ConsumedMessage

if TYPE_CHECKING:
    from kafkatx.listener.host import TransactionHost

__all__ = ["MAX_COMMITS_UNDER_WAY", "PartitionTurns", "one_after_another", "partition_stage"]

#: How many partitions' commits may be under way at once (each further one is handled during the one before
#: it commits: a nesting depth, so kept small).
MAX_COMMITS_UNDER_WAY = 8


class PartitionTurns:
    """Runs a poll's partition slices, each in its own transaction, overlapping their commits (see the module)."""

    def __init__(self, host: TransactionHost, runner: RecordRunner) -> None:
        self._host, self._runner = host, runner
        self._waiting: deque[list[ConsumedMessage]] = deque()
        self._under_way = 0
        self._raised: BaseException | None = None

    def run(self, slices: list[list[ConsumedMessage]]) -> None:
        """One transaction per slice (a partition's records), in order; a commit handles the next slices."""
        waiting = self._waiting
        waiting.extend(slices)
        try:
            while waiting and self._raised is None:
                self._turn(waiting.popleft())
        finally:
            raised, self._raised = self._raised, None
            waiting.clear()
        if raised is not None:  # what stops the container (as it would have at the slice's own turn)
            raise raised

    def _turn(self, msgs: list[ConsumedMessage]) -> None:
        host = self._host
        tp = (msgs[0].topic(), msgs[0].partition())
        if not host.owns(tp):  # revoked meanwhile (a retry partition goes with its input partition)
            return
        self._runner(TransactionUnit(host, host.producer_for(tp), msgs, during_commit=self._while_committing))

    def _while_committing(self) -> None:
        """A transaction commits: run the next slice's, unless enough commits are under way. Never raises (the
        commit under way reports its own outcome); what the slice raised is raised by :meth:`run`."""
        if not self._waiting or self._raised is not None or self._host.stop_event.is_set():
            return
        if self._under_way >= MAX_COMMITS_UNDER_WAY - 1:
            return
        self._under_way += 1
        try:
            with self._runner.inside_another_commit():
                self._turn(self._waiting.popleft())
        except BaseException as exc:  # noqa: BLE001 - raised by run() once the commit under way returned
            self._raised = exc
        finally:
            self._under_way -= 1


def partition_stage(
    host: TransactionHost,
    runner: Callable[[TransactionUnit], None],
    overlap: CommitOverlap | None,
    input_of: Callable[[TP], TP] | None,
) -> Callable[[list[ConsumedMessage]], None]:
    """How a container runs a poll's batch with ``fencing="partition"``: one slice per partition (``input_of``, with
    retry topics: a retry partition's records go with its input partition's, one producer), each its own
    transaction: in turns whose commits overlap (a record runner without ``database=``), through the overlapped
    commit's loop (``overlap_commit=True``), else one after the other."""
    run: Callable[[list[list[ConsumedMessage]]], None]
    if overlap is not None:
        run = functools.partial(overlap.run_partitions, runner=runner)
    elif host.database is None and isinstance(runner, RecordRunner):
        run = PartitionTurns(host, runner).run
    else:
        run = functools.partial(one_after_another, host, runner)
    return functools.partial(_by_partition, run, input_of)


def _by_partition(
    run: Callable[[list[list[ConsumedMessage]]], None],
    input_of: Callable[[TP], TP] | None,
    batch: list[ConsumedMessage],
) -> None:
    """``run`` over ``batch``'s slices, one per partition, in the order their first records came."""
    slices: dict[TP, list[ConsumedMessage]] = {}
    for record in batch:
        tp = (record.topic(), record.partition())
        slices.setdefault(tp if input_of is None else input_of(tp), []).append(record)
    run(list(slices.values()))


def one_after_another(
    host: TransactionHost, runner: Callable[[TransactionUnit], None], slices: list[list[ConsumedMessage]]
) -> None:
    """Each slice's transaction, in order (``database=``: one database transaction at a time; a batch runner)."""
    for msgs in slices:
        tp = (msgs[0].topic(), msgs[0].partition())
        if host.owns(tp):  # not revoked meanwhile (a retry partition goes with its input partition)
            runner(TransactionUnit(host, host.producer_for(tp), msgs))
