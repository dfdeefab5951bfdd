"""tenant weights

`tenants.weight` is a tenant's scheduling tier for the engine's tenant-fair scheduler (2 gets twice the engine
time of 1 while both are backlogged); existing tenants get the base tier, 1.0.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 06:40:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("weight", sa.Float(), server_default=sa.text("1.0"), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("weight")
