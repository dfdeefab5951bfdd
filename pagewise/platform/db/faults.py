"""Which errors mean "the database cannot be reached now": PostgreSQL down or restarting, a connection cut under
a statement, SQLite busy past its timeout. The API answers them with a 503 and `Retry-After` (the client retries;
nothing was decided), the engine side retries its final write; any other database error is a bug and stays one.
"""

from __future__ import annotations

from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

RETRY_AFTER_S = 2  # what a 503 for a database fault tells the client to wait


def is_database_fault(error: BaseException) -> bool:
    """True for a lost or refused connection (asyncpg raises the OS's error when it cannot connect at all), a
    connection the pool had to invalidate, an operational error (PostgreSQL shutting down, SQLite locked), or no
    pooled connection in time."""
    if isinstance(error, DBAPIError):
        return error.connection_invalidated or isinstance(error, OperationalError | InterfaceError)
    return isinstance(error, ConnectionError | PoolTimeoutError)
