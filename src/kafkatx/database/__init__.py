"""A database transaction in the same unit of work as the Kafka transaction, exactly once on both sides.

Declare ``@app.listener(..., database=engine)`` (a SQLAlchemy engine, a URL,
or a function returning a DB-API connection) and use :func:`db` in the
handler. See docs/DATABASE.md for the commit order and the crash argument.
"""

from kafkatx.database.session import DatabaseUnavailableError, db

__all__ = ["db", "DatabaseUnavailableError"]
