"""key priority classes: `api_keys.priority_class` is the best class a key's requests may run at

`NULL` (every existing key) means `interactive`: a request may ask for priority 0 or worse, never better.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 07:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("priority_class", sa.String(16), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("priority_class")
