"""While an App runs, the cyclic garbage collector skips the objects the process started with (``gc.freeze``).

A full collection walks every object the collector tracks. A service holds
tens of thousands from start-up (modules, classes, configuration, pydantic
and OpenTelemetry when they are used), and none of them becomes garbage
while it runs. Every consumed Message is a tracked object, so a busy listener
sets off a full collection about every 100,000 records: measured at 11-17 ms
of the container thread each (0.1-0.2 us per record, a tenth of kafkatx's
own cost per record), and 0.2 ms once the start-up objects are frozen.

``gc.freeze`` moves what is tracked when the App starts into a permanent
generation that collections skip; reference counting still frees those
objects as before, so only a reference cycle among them that is dropped
while the App runs waits. The first App to start freezes; the last one whose
containers have ended unfreezes, so that such cycles are collected again: an
App started and stopped many times in one process keeps nothing. A process
that froze objects itself (``gc.get_freeze_count()`` above zero before any
App froze) is left as it is. ``App(gc_freeze=False)`` turns this off.
"""

from __future__ import annotations

import gc
import threading

__all__ = ["FreezeHolders", "HOLDERS", "StartupFreeze"]


class FreezeHolders:
    """The running Apps that keep the start-up objects frozen; the process has one (:data:`HOLDERS`).

    Only the first holder freezes: what a later App finds (the first one's garbage among it) is not frozen
    again, so a process that starts and stops short-lived Apps beside a long-lived one keeps nothing of theirs.
    The last holder to let go unfreezes.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.count = 0

    def hold(self) -> bool:
        """One more App holds the freeze; False if the process froze objects of its own (then kafkatx does not)."""
        with self._lock:
            if self.count == 0:
                if gc.get_freeze_count():
                    return False  # the application's own freeze: not kafkatx's to manage
                gc.freeze()
            self.count += 1
            return True

    def release(self) -> None:
        """One App less; the last gives the frozen objects back to the collector."""
        with self._lock:
            self.count -= 1
            if self.count == 0:
                gc.unfreeze()


#: The process's holders: every App's :class:`StartupFreeze` counts here.
HOLDERS = FreezeHolders()


class StartupFreeze:
    """One App's hold on the frozen heap: :meth:`hold` at start, :meth:`release` once its containers ended."""

    def __init__(self, holders: FreezeHolders = HOLDERS) -> None:
        self._holders = holders
        self._holding = False

    def hold(self) -> bool:
        """Hold the freeze (freezing what the collector tracks now if no App holds it yet). True if held."""
        if not self._holding:
            self._holding = self._holders.hold()
        return self._holding

    def release(self) -> None:
        """Let go of the freeze, once (a second call, or one without a hold, changes nothing)."""
        if self._holding:
            self._holding = False
            self._holders.release()
