"""Which errors mean "a backing service cannot be reached now" rather than a bug: the database (PostgreSQL down
or restarting, a connection cut under a statement, SQLite busy past its timeout) and Redis (a lost or refused
connection, a Redis still loading, a stream or group gone under a read). The API answers them with a 503 and
`Retry-After` (the client retries; nothing was decided), the engine side retries what it was doing; any other
error is a bug and stays one.
"""

from __future__ import annotations

import redis.asyncio as redis
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeoutError

RETRY_AFTER_S = 2  # what a 503 for a fault tells the client to wait


def is_database_fault(error: BaseException) -> bool:
    """True for a lost or refused connection (asyncpg raises the OS's error when it cannot connect at all), a
    connection the pool had to invalidate, an operational error (PostgreSQL shutting down, SQLite locked), or no
    pooled connection in time."""
    if isinstance(error, DBAPIError):
        return error.connection_invalidated or isinstance(error, OperationalError | InterfaceError)
    return isinstance(error, ConnectionError | PoolTimeoutError)


def is_redis_fault(error: BaseException) -> bool:
    """A lost or refused connection (a Redis still loading its data included), or a stream or group gone under
    a read (Redis restarted without its data, or flushed while a read was blocked on it)."""
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return True
    return isinstance(error, redis.ResponseError) and str(error).startswith(("NOGROUP", "UNBLOCKED"))
