"""Which Redis errors are faults (the worker rides them out with backoff, the API answers 503) and which are
raised as bugs."""

from __future__ import annotations

import pytest
import redis.asyncio as redis

from pagewise.serving.faults import is_redis_fault


@pytest.mark.parametrize(
    "error",
    [
        redis.ConnectionError("Connection closed by server."),
        redis.TimeoutError("Timeout reading from socket"),
        redis.BusyLoadingError("Redis is loading the dataset in memory"),
        redis.ResponseError("NOGROUP No such key 'x:submit:w' or consumer group 'workers' in XREADGROUP"),
        redis.ResponseError("UNBLOCKED the stream key no longer exists"),
    ],
)
def test_a_restart_or_a_flush_is_ridden_out(error: Exception) -> None:
    assert is_redis_fault(error)


@pytest.mark.parametrize(
    "error",
    [
        redis.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"),
        redis.ResponseError("ERR syntax error, mentions NOGROUP later"),
        ValueError("a bug, not a fault"),
    ],
)
def test_anything_else_is_raised(error: Exception) -> None:
    assert not is_redis_fault(error)
