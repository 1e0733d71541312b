"""While an App runs the garbage collector skips the start-up objects (gc.freeze); the last App to stop gives
them back, and a process's own freeze is left alone (kafkatx.app.heap)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kafkatx.app.heap import StartupFreeze


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_cycle_dropped_while_frozen_is_collected_once_the_freeze_is_released() -> None:
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    freeze = StartupFreeze()
    assert freeze.hold() and gc.get_freeze_count() > 0
    del cycle
    gc.collect()
    assert alive() is not None, "frozen: full collections skip it (what makes them cheap)"
    freeze.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None, "nothing kept once the App stopped"


def test_the_last_app_to_stop_unfreezes() -> None:
    first, second = StartupFreeze(), StartupFreeze()
    assert first.hold() and second.hold()
    first.release()
    first.release()  # a second stop changes nothing
    assert gc.get_freeze_count() > 0, "the second App still runs"
    second.release()
    assert gc.get_freeze_count() == 0


def test_a_freeze_of_the_applications_own_is_left_alone() -> None:
    gc.freeze()
    own = gc.get_freeze_count()
    freeze = StartupFreeze()
    assert not freeze.hold()
    freeze.release()
    assert gc.get_freeze_count() == own, "not kafkatx's to unfreeze"
