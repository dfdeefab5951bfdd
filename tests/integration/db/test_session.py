"""The engines keep statement parameters (prompt text) out of SQLAlchemy's errors and logs."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy.exc import IntegrityError

from pagewise.platform.db.database import Database
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.db.session import create_db_engine, create_sessionmaker
from pagewise.platform.requests.store import RequestStore

pytestmark = pytest.mark.anyio

SECRET_PROMPT = "my password is hunter2"


def _orphan_row() -> RequestRecord:
    return RequestRecord(
        id="cmpl_no_such_tenant",
        tenant_id="tnt_no_such_tenant",  # the foreign key fails
        endpoint="completions",
        model="m",
        input={"prompt": SECRET_PROMPT},
        params={},
        queued_at=dt.datetime.now(dt.UTC),
    )


def _assert_hidden(failure: pytest.ExceptionInfo[IntegrityError]) -> None:
    assert "SQL parameters hidden" in str(failure.value)
    assert SECRET_PROMPT not in str(failure.value)


async def test_a_failing_insert_does_not_show_its_parameters(database_url: str) -> None:
    engine = create_db_engine(database_url)
    try:
        async with create_sessionmaker(engine)() as session:
            session.add(_orphan_row())
            with pytest.raises(IntegrityError) as failure:
                await session.commit()
    finally:
        await engine.dispose()
    _assert_hidden(failure)


async def test_a_failing_unit_of_work_does_not_show_its_parameters(database: Database) -> None:
    """The request path's units (on SQLite, a second engine of their own) hide them too."""
    with pytest.raises(IntegrityError) as failure:
        await RequestStore(database).create(_orphan_row())
    _assert_hidden(failure)
