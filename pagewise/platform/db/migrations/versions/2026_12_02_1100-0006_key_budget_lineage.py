"""key budget lineage: `api_keys.budget_key_id`, the first key of a key's rotations, whose budget it shares

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 11:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("budget_key_id", sa.String(length=40), nullable=True))
        batch.create_index("ix_api_keys_budget_key_id", ["budget_key_id"])


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_index("ix_api_keys_budget_key_id")
        batch.drop_column("budget_key_id")
