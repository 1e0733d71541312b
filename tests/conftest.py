"""Shared test settings. The broker fixtures come from kafkatx's own pytest plugin."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

logging.getLogger("kafkatx").setLevel(logging.DEBUG)
# py4j logs from __del__ at interpreter exit, after pytest has closed its streams.
logging.getLogger("py4j").setLevel(logging.WARNING)


@pytest.fixture
def pg_engine(postgres: Any) -> Iterator[Any]:
    """A SQLAlchemy engine on the session's PostgreSQL server (see kafkatx.testing's ``postgres``)."""
    import sqlalchemy as sa

    engine = sa.create_engine(postgres.url, pool_size=4)
    yield engine
    engine.dispose()
