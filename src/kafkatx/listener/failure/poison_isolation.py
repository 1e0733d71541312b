"""Poison isolation: which records of a failing batch make it fail, found by halves.

A batch handler (a Spark job, a batch listener's function) can fail because
of one record among thousands, and the exception does not say which. Once
the batch's attempts are spent, :func:`isolate` searches the failing set by
halves, in rounds:

1. run the handler on the first half of the failing set: if it fails, keep
   that half; if it passes, the second half is the culprit (not run);
2. repeat down to one record: it is poison (with the error of the smallest
   run that failed because of it);
3. run the handler over all the records not found poison: if it passes, its
   result is the one the caller commits (a handler can aggregate, so the
   union of half-batch results is not the batch's result, and no half's
   result is ever kept); if it fails, the next round searches the records
   left.

k poison records among n cost about k·(log2(n) + 1) runs; for k = 1 that is
the minimum a search by halves can do. ``max_runs`` (the listeners'
``max_bisect_jobs``) bounds the runs: once reached, the set known to fail is
returned as suspects, every record of it, with a note in the exception saying
so; records are never skipped. An error that cannot depend on the data (a
schema error) makes every remaining record a suspect at once.

The Spark runner (:mod:`kafkatx.spark._runner`) and the batch runner
(:mod:`kafkatx.listener.runners.batch_runner`) both call it; what happens to
the poison records (the recoverer, in the batch's transaction) is theirs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["DEFAULT_MAX_BISECT_JOBS", "Isolated", "IsolationStopped", "RunFailed", "isolate"]

log = logging.getLogger("kafkatx.rollback")

T = TypeVar("T")

#: Runs a batch's poison isolation may make: about k·(log2(n) + 1) for k poison records among n.
DEFAULT_MAX_BISECT_JOBS = 128


class RunFailed(Exception):
    """A run of the handler over some of the batch's records failed with ``exc``."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(exc)
        self.exc = exc


class IsolationStopped(Exception):
    """The container stops: the search is given up, nothing decided."""


@dataclass(slots=True)
class Isolated(Generic[T]):
    """What :func:`isolate` found: the poison records (by index) with their errors, and the result of the run
    over all the others (None when there is none: every record was poison)."""

    result: T | None
    poison: dict[int, BaseException] = field(default_factory=dict)
    #: Runs made (probes and final runs).
    runs: int = 0
    #: The failure of the last failing run (what the caller may check is no record's, e.g. a dead session).
    last_failure: BaseException | None = None


class _Budget:
    def __init__(self, limit: int) -> None:
        self.limit, self.used = limit, 0

    @property
    def exhausted(self) -> bool:
        return self.used >= self.limit


def _never(exc: BaseException) -> bool:
    return False


def isolate(
    run: Callable[[list[int]], T],
    candidates: list[int],
    failure: BaseException,
    *,
    max_runs: int,
    stopping: Callable[[], bool],
    data_independent: Callable[[BaseException], bool] = _never,
    label: str = "listener",
) -> Isolated[T]:
    """Find the records of ``candidates`` whose presence makes ``run`` fail (see the module).

    ``run(indices)`` runs the handler over those records and returns its
    result, or raises :class:`RunFailed`. ``failure`` is the error of the run
    over all ``candidates``. :class:`IsolationStopped` is raised when
    ``stopping()`` says so before a run.
    """
    budget = _Budget(max_runs)
    poison: dict[int, BaseException] = {}
    remaining = candidates
    result: T | None = None
    while True:
        if data_independent(failure):
            found = dict.fromkeys(remaining, failure)
        else:
            found = _find_one(run, remaining, failure, budget, stopping, label)
        poison.update(found)
        good = [i for i in remaining if i not in found]
        if not good:
            break
        if stopping():
            raise IsolationStopped
        budget.used += 1
        try:
            result = run(good)
            break
        except RunFailed as again:
            remaining, failure = good, again.exc
    return Isolated(result, dict(sorted(poison.items())), budget.used, failure)


def _find_one(
    run: Callable[[list[int]], object],
    failing: list[int],
    failure: BaseException,
    budget: _Budget,
    stopping: Callable[[], bool],
    label: str,
) -> dict[int, BaseException]:
    """One poison record of ``failing`` (a set known to fail with ``failure``), with its error."""
    while len(failing) > 1:
        if budget.exhausted:
            return _suspects(failing, failure, budget, label)
        mid = len(failing) // 2
        if stopping():
            raise IsolationStopped
        budget.used += 1
        try:
            run(failing[:mid])
        except RunFailed as failed:
            failing, failure = failing[:mid], failed.exc
        else:
            failing = failing[mid:]  # the first half passes: the failure came from the second
    return {failing[0]: failure}


def _suspects(failing: list[int], failure: BaseException, budget: _Budget, label: str) -> dict[int, BaseException]:
    note = (
        f"kafkatx: bisection stopped at max_bisect_jobs={budget.limit}; this record was dead-lettered as one "
        f"of {len(failing)} suspects whose job failed together"
    )
    if note not in getattr(failure, "__notes__", ()):
        failure.add_note(note)
    log.warning("%s: %s", label, note)
    return dict.fromkeys(failing, failure)
