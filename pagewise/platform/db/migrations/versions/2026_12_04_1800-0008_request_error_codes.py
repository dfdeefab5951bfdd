"""request error codes: `requests.error_code` holds a failed row's ErrorCode, `error` its public message

Before, a failed row's `error` held "<code>: <message>" in one string, parsed back wherever it was read; rows a
sweep failed held "orphaned: …" or "interrupted: …", which read as `worker_lost`. The upgrade splits existing rows
that way; the downgrade joins them again.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 18:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# the ErrorCode values when this revision was written (a migration does not import the code it migrates)
CODES = ("invalid_request", "engine_unavailable", "worker_lost", "queue_timeout", "internal_error")


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("error_code", sa.String(32), nullable=True))
    requests = sa.table("requests", sa.column("error", sa.Text), sa.column("error_code", sa.String))
    for code in CODES:
        prefix = f"{code}: "
        op.execute(
            requests.update()
            .where(sa.func.substr(requests.c.error, 1, len(prefix)) == prefix)
            .values(error_code=code, error=sa.func.substr(requests.c.error, len(prefix) + 1))
        )
    op.execute(
        requests.update()
        .where(requests.c.error.is_not(None), requests.c.error_code.is_(None))
        .values(error_code="worker_lost")
    )


def downgrade() -> None:
    requests = sa.table("requests", sa.column("error", sa.Text), sa.column("error_code", sa.String))
    op.execute(
        requests.update()
        .where(requests.c.error_code.is_not(None))
        .values(error=requests.c.error_code + ": " + sa.func.coalesce(requests.c.error, ""))
    )
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("error_code")
