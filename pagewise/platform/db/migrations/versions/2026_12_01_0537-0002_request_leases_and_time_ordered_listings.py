"""request leases and time-ordered listings

`requests.lease_expires_at` lets the orphan sweep fail rows whose process died; listings sort newest first on
`(queued_at, id)`, so `(tenant_id, queued_at, id)` replaces the index on `(tenant_id, id)`.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 05:37:42.819638+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.drop_index("ix_requests_tenant_id_id")
        batch_op.create_index(
            "ix_requests_tenant_id_queued_at_id", ["tenant_id", "queued_at", "id"], unique=False
        )


def downgrade() -> None:
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_tenant_id_queued_at_id")
        batch_op.create_index("ix_requests_tenant_id_id", ["tenant_id", "id"], unique=False)
        batch_op.drop_column("lease_expires_at")
