"""Which exceptions of a database driver mean what: read by failure classification and by ``database=``.

DB-API drivers (and SQLAlchemy) name their exception classes after PEP 249;
kafkatx recognises them by those names along the class's bases, in a module
that is a driver (it has ``paramstyle``) or SQLAlchemy, so no driver is
imported to ask.
"""

from __future__ import annotations

import functools
import sys

__all__ = ["is_connection_error", "permanent_database_error_class"]

_CONNECTION_ERRORS = ("OperationalError", "InterfaceError")
_PERMANENT_ERRORS = ("IntegrityError", "DataError", "ProgrammingError", "NotSupportedError")


@functools.lru_cache(maxsize=1024)
def _database_base(cls: type, names: tuple[str, ...]) -> type | None:
    """The base of ``cls`` named like one of the DB-API exceptions ``names``, in a database driver or SQLAlchemy.

    Kept per class: every failed call asks it of each exception on its cause chain, and a class's bases and
    their modules do not change."""
    for base in cls.__mro__:
        if base.__name__ in names:
            root = base.__module__.split(".")[0]
            if root == "sqlalchemy" or hasattr(sys.modules.get(root), "paramstyle"):
                return base
    return None


def is_connection_error(exc: BaseException) -> bool:
    """A DB-API/SQLAlchemy error about the connection or the server (retry later), not the statement."""
    return _database_base(type(exc), _CONNECTION_ERRORS) is not None  # type: ignore[arg-type]


def permanent_database_error_class(cls: type) -> type | None:
    """For a constraint violation, bad data or bad SQL (it fails again on every attempt): its DB-API base class."""
    return _database_base(cls, _PERMANENT_ERRORS)
