"""A coroutine returned by a plain handler is a programming error: the container stops, nothing dead-lettered."""

from __future__ import annotations

import gc
import warnings
from typing import Any

import pytest
from fakes import FakeHost, listener, messages

from kafkatx import InvalidConfigurationError, Record


@pytest.mark.parametrize("retry", ["rollback", "in_place"])
def test_a_coroutine_returned_by_a_sync_wrapper_stops_instead_of_dead_lettering(retry: str) -> None:
    recovered: list[int] = []

    async def enrich(record: Record) -> bytes | None:
        return record.value

    def wrapped(record: Record) -> Any:  # a decorator without functools.wraps hides the async def
        return enrich(record)

    host = FakeHost(listener(wrapped, retry=retry, dlq=lambda r, e: recovered.append(r.offset)))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(InvalidConfigurationError, match=r"wrapped': its handler returned a coroutine"):
            host.runner()(host.unit(messages(b"a", b"b")))
        gc.collect()
    assert not [w for w in seen if "never awaited" in str(w.message)], "the refused coroutine is closed"
    assert recovered == [] and not host.producer.committed, "nothing dead-lettered, nothing committed"
