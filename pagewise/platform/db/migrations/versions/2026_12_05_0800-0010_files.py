"""files: tenants' uploaded files (OpenAI's Files API), their bytes in the file store

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 08:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("api_key_id", sa.String(40), sa.ForeignKey("api_keys.id", ondelete="SET NULL"), nullable=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(256), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deleted_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_files_tenant_id_created_at_id", "files", ["tenant_id", "created_at", "id"])


def downgrade() -> None:
    op.drop_index("ix_files_tenant_id_created_at_id", table_name="files")
    op.drop_table("files")
