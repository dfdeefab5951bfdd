"""batches: OpenAI's Batch API — batches, their lines (keyed by batch and custom_id), `requests.batch_id`,
`usage_daily.batch_id` in its primary key (`""` for interactive usage, every row from before), and
`model_prices.batch_percent` (the share of the price a batch line pays; 50 for every existing price)

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-05 08:30:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _moment(name: str, nullable: bool = True) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable)


def upgrade() -> None:
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("tenant_id", sa.String(40), sa.ForeignKey("tenants.id", ondelete="CASCADE"), nullable=False),
        sa.Column("api_key_id", sa.String(40), sa.ForeignKey("api_keys.id", ondelete="SET NULL"), nullable=True),
        sa.Column("input_file_id", sa.String(40), sa.ForeignKey("files.id", ondelete="CASCADE"), nullable=False),
        sa.Column("endpoint", sa.String(32), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("output_file_id", sa.String(40), nullable=True),
        sa.Column("error_file_id", sa.String(40), nullable=True),
        _moment("created_at", nullable=False),
        _moment("in_progress_at"),
        _moment("expires_at", nullable=False),
        _moment("finalizing_at"),
        _moment("completed_at"),
        _moment("expired_at"),
        _moment("cancelling_at"),
        _moment("cancelled_at"),
    )
    op.create_index("ix_batches_tenant_id_id", "batches", ["tenant_id", "id"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(40), sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("custom_id", sa.String(512), primary_key=True),
        sa.Column("line", sa.Integer(), nullable=False),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("request_id", sa.String(40), nullable=True),
        _moment("claimed_at"),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("result", sa.JSON(), nullable=True),
    )
    op.create_index("ix_batch_lines_batch_id_status_line", "batch_lines", ["batch_id", "status", "line"])
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("batch_id", sa.String(40), nullable=True))
    with op.batch_alter_table("model_prices") as batch:
        batch.add_column(sa.Column("batch_percent", sa.Integer(), server_default=sa.text("50"), nullable=False))
    _replace_usage_daily(
        [sa.Column("batch_id", sa.String(40), server_default=sa.text("''"), nullable=False)],
        "SELECT tenant_id, day, model, api_key_id, '', requests, prompt_tokens, completion_tokens, cached_tokens,"
        " cost_micros FROM usage_daily",
    )


def _replace_usage_daily(batch_column: list[sa.Column], select: str) -> None:
    """Rebuild `usage_daily` with (`batch_column` or none) after `api_key_id` in its primary key, filled by
    `select` from the old one: a new table, copied, renamed (as revision 0004 did)."""
    op.create_table(
        "usage_daily_next",
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("api_key_id", sa.String(length=40), server_default=sa.text("''"), nullable=False),
        *batch_column,
        sa.Column("requests", sa.Integer(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cost_micros", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", "day", "model", "api_key_id", *(c.name for c in batch_column)),
    )
    op.execute(f"INSERT INTO usage_daily_next {select}")
    op.drop_table("usage_daily")
    op.rename_table("usage_daily_next", "usage_daily")


def downgrade() -> None:
    """A batch's usage merges back into its key's day."""
    _replace_usage_daily(
        [],
        "SELECT tenant_id, day, model, api_key_id, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens),"
        " SUM(cached_tokens), SUM(cost_micros) FROM usage_daily GROUP BY tenant_id, day, model, api_key_id",
    )
    with op.batch_alter_table("model_prices") as batch:
        batch.drop_column("batch_percent")
    with op.batch_alter_table("requests") as batch:
        batch.drop_column("batch_id")
    op.drop_index("ix_batch_lines_batch_id_status_line", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_index("ix_batches_tenant_id_id", table_name="batches")
    op.drop_table("batches")
