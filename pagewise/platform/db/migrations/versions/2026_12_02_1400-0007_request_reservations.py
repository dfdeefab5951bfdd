"""request reservations: `requests.reserved_tokens` and `reserved_micros`, what admission reserved for the request

A monthly counter rebuilt from the database (Redis lost its data) counts an unfinished request at what it
reserved: its reservation went with the data, and its usage is not in `usage_daily` yet.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 14:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("reserved_tokens", sa.BigInteger(), nullable=False, server_default="0"))
        batch.add_column(sa.Column("reserved_micros", sa.BigInteger(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("reserved_micros")
        batch.drop_column("reserved_tokens")
