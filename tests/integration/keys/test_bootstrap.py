"""The first start's admin key: generated, or the operator's `PAGEWISE_ADMIN_KEY`, on an empty database only."""

from __future__ import annotations

import secrets

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import ApiKey, Tenant
from pagewise.platform.errors import APIError
from pagewise.platform.keys.auth import authenticate
from pagewise.platform.keys.key_format import hash_secret
from pagewise.platform.keys.service import BOOTSTRAP_TENANT, KeyService

from ..harness import bearer

pytestmark = pytest.mark.anyio


def _operator_key() -> str:
    return f"pw_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}"


async def _count(session: AsyncSession, model: type) -> int:
    return int(await session.scalar(select(func.count()).select_from(model)) or 0)


async def test_a_given_admin_key_is_stored_as_that_key(
    empty_db: async_sessionmaker[AsyncSession], empty_database: Database
) -> None:
    chosen = _operator_key()
    async with empty_db() as session:
        created = await KeyService(session).bootstrap_admin(chosen)
        assert created is not None and created.key == chosen
        assert created.scopes == ["admin", "inference"] and created.status == "active"
        stored = await session.get(ApiKey, created.id)
        assert stored is not None
        assert (stored.prefix, stored.secret_sha256) == (chosen[3:15], hash_secret(chosen[16:]))
        principal = await authenticate(empty_database, bearer(chosen)["Authorization"])
        assert principal.tenant_name == BOOTSTRAP_TENANT and "admin" in principal.scopes


async def test_a_non_empty_database_is_left_alone(
    empty_db: async_sessionmaker[AsyncSession], empty_database: Database
) -> None:
    """`PAGEWISE_ADMIN_KEY` seeds an empty database only: later it neither adds nor replaces a key."""
    async with empty_db() as session:
        generated = await KeyService(session).bootstrap_admin()
        assert generated is not None and generated.key.startswith("pw_")
        later = _operator_key()
        assert await KeyService(session).bootstrap_admin(later) is None
        assert (await _count(session, Tenant), await _count(session, ApiKey)) == (1, 1)
        with pytest.raises(APIError) as unknown:
            await authenticate(empty_database, bearer(later)["Authorization"])
        assert unknown.value.status_code == 401


@pytest.mark.parametrize(
    ("key", "problem"),
    [
        ("sk-live-123", "not of the form pw_<prefix>_<secret>"),
        (f"pw_{'AB' * 6}_{'s' * 40}", "12 lowercase hexadecimal digits"),
        (f"pw_{'ab' * 6}_{'s' * 31}", "secret has 31 characters; at least 32"),
        (f"pw_{'ab' * 6}_{'s' * 31}!", "only letters, digits, '-' and '_'"),
    ],
)
async def test_a_malformed_admin_key_is_a_readable_value_error(
    empty_db: async_sessionmaker[AsyncSession], key: str, problem: str
) -> None:
    async with empty_db() as session:
        with pytest.raises(ValueError, match="PAGEWISE_ADMIN_KEY") as malformed:
            await KeyService(session).bootstrap_admin(key)
        assert problem in str(malformed.value) and key not in str(malformed.value)
        assert await _count(session, Tenant) == 0
