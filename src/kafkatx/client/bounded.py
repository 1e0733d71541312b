"""Blocking client calls with a deadline that holds even when librdkafka ignores its own timeout.

librdkafka can block past the timeout it was given: after a broker bounce,
``send_offsets_to_transaction(..., 3.75)`` was seen blocking for more than
five minutes (confluentinc/librdkafka#5456, #5511). A container stuck there
cannot stop, commit, or be fenced cleanly.

:class:`BoundedCaller` runs each call on a helper thread (confluent-kafka
releases the GIL while it waits, so the container thread only waits on an
event) and gives up at the deadline with :class:`~kafkatx.StuckCallError`,
an application-recoverable error: the container abandons the client, starts
a new one with the same transactional.id (which fences the stuck one, so
whatever it does when it wakes up cannot commit), and rewinds to the
committed offsets. The abandoned helper thread is left to finish the stuck
call on its own; the job it runs checks :attr:`BoundedCaller.abandoned`
before its next client call and stops there (a commit job does not commit:
the embedded broker, after a restart, gives the new producer another
producer id, so it does not fence the stuck one; docs/BROKERS.md). The
client is never touched again from kafkatx's side.

Every caller also says what it is blocked in (:attr:`BoundedCaller.current`),
so a stop that does not finish within ``shutdown_timeout`` can name the call.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kafkatx.errors import StuckCallError

__all__ = ["BoundedCaller", "CallInProgress"]

T = TypeVar("T")


class CallInProgress:
    """What a caller is blocked in: ``operation`` since ``started`` (time.monotonic()), given up after ``deadline`` s."""

    __slots__ = ("operation", "started", "deadline", "done", "result", "error")

    def __init__(self, operation: str, deadline: float | None = None) -> None:
        self.operation = operation
        self.started = time.monotonic()
        #: Seconds after which the caller abandons the call (None: no deadline).
        self.deadline = deadline
        # Released by the helper thread when the call returns. A bare lock, not a threading.Event: the
        # container waits on it twice per transaction, and Event's Python-level Condition costs more than the wait.
        self.done = threading.Lock()
        self.done.acquire()
        self.result: Any = None
        self.error: BaseException | None = None

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    def describe(self) -> str:
        return f"{self.operation} (blocked for {self.seconds:.0f}s)"


class BoundedCaller:
    """Runs blocking calls on a helper thread; a call past its deadline is abandoned, not waited for."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], CallInProgress] | None] | None = None
        self.current: CallInProgress | None = None
        #: The call running while its caller does other work (``call(..., meanwhile=...)``), until it waits for it.
        self.running: CallInProgress | None = None
        #: Set once a call was abandoned: the client it used must not be touched again.
        self.abandoned = False

    def call(
        self, operation: str, fn: Callable[[], T], deadline: float, meanwhile: Callable[[], None] | None = None
    ) -> T:
        """``fn()`` on the helper thread; StuckCallError if it has not returned after ``deadline`` seconds.

        ``fn`` may rename the call in progress (``current.operation``) as it moves from one client call to the next.
        ``meanwhile`` runs on the calling thread while ``fn`` runs (the overlapped commit); the caller is not
        blocked then, so :attr:`current` is None and :attr:`running` names the call.
        """
        jobs = self._jobs
        if jobs is None:
            jobs = self._jobs = queue.SimpleQueue()
            threading.Thread(target=_serve, args=(jobs,), name=f"kafkatx-call-{self.name}", daemon=True).start()
        job = CallInProgress(operation, deadline)
        self.current = job
        jobs.put((fn, job))
        interrupted: BaseException | None = None
        try:
            if meanwhile is not None:
                self.current, self.running = None, job
                try:
                    meanwhile()
                except BaseException as exc:  # noqa: BLE001 - raised once the call returned, not while it runs
                    interrupted = exc
                finally:
                    self.current, self.running = job, None
            if not job.done.acquire(timeout=max(0.0, deadline - job.seconds) if meanwhile else deadline):
                self.abandoned = True
                self._jobs = None  # the helper thread is stuck with this call; the next call gets a new one
                jobs.put(None)  # ... and this one ends once the stuck call returns
                raise StuckCallError(
                    f"{job.operation} did not return within {deadline:.3g}s (librdkafka ignored its timeout); "
                    f"abandoning producer {self.name} and starting a new one with the same transactional.id",
                    operation=job.operation,
                )
        finally:
            self.current = None
        if interrupted is not None:
            raise interrupted
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    def wait_running(self) -> bool | None:
        """Wait for the call in :attr:`running` to return, within its deadline (its caller reads its result later).

        True if it returned without an error, False if it failed (or did not return in time), None if no call is
        running.
        """
        job = self.running
        if job is None:
            return None
        if not job.done.acquire(timeout=max(0.0, (job.deadline or 0.0) - job.seconds) if job.deadline else -1):
            return False
        job.done.release()  # the caller acquires it again when it gets back to waiting
        return job.error is None

    def running_done(self) -> bool:
        """True unless a call started with ``meanwhile`` is still running on the helper thread within its deadline."""
        job = self.running
        return job is None or not job.done.locked() or (job.deadline is not None and job.seconds >= job.deadline)

    @property
    def in_progress(self) -> CallInProgress | None:
        """The call this caller is blocked in, or that runs while it does other work: until it returns."""
        job = self.current
        if job is None:
            job = self.running
            if job is not None and not job.done.locked():
                return job
        return job

    def close(self) -> None:
        jobs, self._jobs = self._jobs, None
        if jobs is not None:
            jobs.put(None)


def _serve(jobs: queue.SimpleQueue[tuple[Callable[[], Any], CallInProgress] | None]) -> None:
    while True:
        item = jobs.get()
        if item is None:
            return
        fn, job = item
        try:
            job.result = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            job.error = exc
        finally:
            job.done.release()
