"""Which database errors mean "the database cannot be reached now" rather than a bug: PostgreSQL down or
restarting, a connection cut under a statement, SQLite busy past its timeout. Like Redis's (`pagewise.serving.
faults`), the API answers them with a 503 and `Retry-After`, and the engine side retries its final write."""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError


def is_database_fault(error: BaseException) -> bool:
    """True for a lost or refused connection (asyncpg raises the OS's error when it cannot connect at all), a
    connection the pool had to invalidate, an operational error (PostgreSQL shutting down, SQLite locked), or no
    pooled connection in time."""
    if isinstance(error, DBAPIError):
        return error.connection_invalidated or isinstance(error, OperationalError | InterfaceError)
    return isinstance(error, ConnectionError | PoolTimeoutError)
