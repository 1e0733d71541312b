"""While an App runs the garbage collector skips the start-up objects (gc.freeze); the last App to stop gives
them back, and a process's own freeze is left alone (kafkatx.app.heap). Each test counts its own holders, as
another test's App may still hold the process's."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from kafkatx.app.heap import HOLDERS, FreezeHolders, StartupFreeze
from kafkatx.testing import wait_for


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    # gc.freeze is the process's: an App of an earlier test still stopping would unfreeze under these tests.
    wait_for(lambda: HOLDERS.count == 0, 30, message="an App of an earlier test still holds the process's freeze")
    gc.unfreeze()
    yield
    gc.unfreeze()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_cycle_dropped_while_frozen_is_collected_once_the_freeze_is_released() -> None:
    cycle = _Cycle()
    alive = weakref.ref(cycle)
    freeze = StartupFreeze(FreezeHolders())
    assert freeze.hold() and gc.get_freeze_count() > 0
    del cycle
    gc.collect()
    assert alive() is not None, "frozen: full collections skip it (what makes them cheap)"
    freeze.release()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None, "nothing kept once the App stopped"


def test_the_first_app_freezes_and_the_last_one_unfreezes() -> None:
    holders = FreezeHolders()
    first, second = StartupFreeze(holders), StartupFreeze(holders)
    assert first.hold()
    frozen = gc.get_freeze_count()
    late = _Cycle()  # made while the first App runs: the second App's start does not freeze it
    alive = weakref.ref(late)
    # (frozen objects another thread lets go of leave the count: it can only go down meanwhile, never up)
    assert second.hold() and gc.get_freeze_count() <= frozen, "the second App's start froze nothing more"
    del late
    gc.collect()
    assert alive() is None
    first.release()
    first.release()  # a second stop changes nothing
    assert 0 < gc.get_freeze_count() <= frozen, "the second App still runs: still frozen"
    second.release()
    assert gc.get_freeze_count() == 0


def test_a_freeze_of_the_applications_own_is_left_alone() -> None:
    gc.freeze()
    own = gc.get_freeze_count()
    freeze = StartupFreeze(FreezeHolders())
    assert not freeze.hold()
    freeze.release()
    # Still frozen (an unfreeze would make it 0); a thread of an earlier test that lets go of frozen objects
    # meanwhile takes them out of the count, so it may be lower, never higher.
    assert 0 < gc.get_freeze_count() <= own, "not kafkatx's to unfreeze"
