"""A SparkSession already running in the process is used, unless kafkatx was asked for another master (refused)."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest

from kafkatx import App, InvalidConfigurationError
from kafkatx.spark import _session


@pytest.fixture
def running_session(monkeypatch: pytest.MonkeyPatch) -> Any:
    """A classic session on local[2] that someone else started (no JVM here: only what kafkatx reads of it)."""
    session = SimpleNamespace(sparkContext=SimpleNamespace(master="local[2]"), _sc=None)
    monkeypatch.setattr(_session, "_existing_session", lambda: session)
    monkeypatch.setattr(_session._Shared, "session", None)
    monkeypatch.setattr(_session._Shared, "users", 0)
    monkeypatch.setattr(_session._Shared, "creator", None)
    monkeypatch.delenv(_session.ENV_MASTER, raising=False)
    return session


def test_a_master_asked_for_that_the_running_session_does_not_have_is_refused_naming_both(
    running_session: Any,
) -> None:
    app = App("spark-existing", bootstrap_servers="127.0.0.1:1")
    _session.configure(app, master="spark://cluster:7077", warm_up=False)
    with pytest.raises(InvalidConfigurationError, match=r"'local\[2\]'.*'spark://cluster:7077'.*session="):
        _session.SessionLease(app).acquire()


def test_the_environments_master_counts_as_asked_for(running_session: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_session.ENV_MASTER, "local[4]")
    app = App("spark-existing-env", bootstrap_servers="127.0.0.1:1")
    _session.configure(app, warm_up=False)
    with pytest.raises(InvalidConfigurationError, match="KAFKATX_SPARK_MASTER"):
        _session.SessionLease(app).acquire()


def test_with_no_master_asked_for_or_the_same_one_the_running_session_is_used_and_its_master_logged(
    running_session: Any, caplog: pytest.LogCaptureFixture
) -> None:
    for master in (None, "local[2]"):
        app = App(f"spark-existing-{master}", bootstrap_servers="127.0.0.1:1")
        _session.configure(app, master=master, warm_up=False)
        lease = _session.SessionLease(app)
        with caplog.at_level(logging.INFO, logger=_session.log.name):
            assert lease.acquire() is running_session
        assert "master local[2]" in caplog.text
        lease.release()
