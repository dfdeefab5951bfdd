"""Which Redis errors mean "Redis cannot be reached now" rather than a bug: a lost or refused connection, a Redis
still loading, a stream or group gone under a read. The API answers them with a 503 and `Retry-After` (the client
retries; nothing was decided), the engine side retries what it was doing; any other error is a bug and stays one.
The database's own such errors are told apart by `pagewise.platform.db.faults` (the core asks its request ledger:
`RequestLedger.is_unreachable`).
"""

from __future__ import annotations

import redis.asyncio as redis

RETRY_AFTER_S = 2  # what a 503 for a fault tells the client to wait


def is_redis_fault(error: BaseException) -> bool:
    """A lost or refused connection (a Redis still loading its data included), or a stream or group gone under
    a read (Redis restarted without its data, or flushed while a read was blocked on it)."""
    if isinstance(error, redis.ConnectionError | redis.TimeoutError):
        return True
    return isinstance(error, redis.ResponseError) and str(error).startswith(("NOGROUP", "UNBLOCKED"))
