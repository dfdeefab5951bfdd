"""A one-line answer to "can this process reach its Redis?", asked before anything slow starts."""

from __future__ import annotations

import redis.asyncio as redis

CONNECT_TIMEOUT_S = 5


class RedisUnreachableError(ConnectionError):
    """Redis does not answer; the message is one line naming the address (never a password) and the cause."""


def redis_address(url: str) -> str:
    """`host:port/db` of a Redis URL, without scheme or credentials."""
    return url.split("://", 1)[-1].rsplit("@", 1)[-1]


async def check_redis(url: str) -> None:
    """PING the server, or raise `RedisUnreachableError`."""
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT_S)
    try:
        await client.ping()
    except (redis.RedisError, OSError) as error:
        raise RedisUnreachableError(f"cannot reach Redis at {redis_address(url)}: {error}") from None
    finally:
        await client.aclose()
