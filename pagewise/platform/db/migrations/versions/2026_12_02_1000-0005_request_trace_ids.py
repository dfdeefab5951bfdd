"""request trace ids: `requests.trace_id`, the request's OpenTelemetry trace when tracing was on

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-02 10:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("trace_id", sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("trace_id")
