"""billing: prices, cost, per-key limits and usage, exports, retention

- `model_prices`: versioned per-model prices in integer micro-dollars per million tokens.
- `requests.cost_micros` and `price_id` (the cost the final write computed, and from which price);
  `body_purged_at` (retention dropped the input and output); an index on `finished_at` (hourly usage,
  roll-up checks, retention).
- `usage_daily` gains `api_key_id` in its primary key and `cost_micros`. Rows from before carry `""`: they were
  never attributed to a key, and rebuilding them from request rows is not attempted.
- `api_keys` gain their own limits (`requests_per_minute`, `tokens_per_minute`, `monthly_token_budget`,
  `monthly_spend_budget_micros`, `allowed_models`); `tenants` gain `monthly_spend_budget_micros`.
- `billing_exports`: one row per revision of a tenant's monthly export.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 09:00:00.000000+00:00
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_KEY_LIMITS = (
    ("requests_per_minute", sa.Integer()),
    ("tokens_per_minute", sa.Integer()),
    ("monthly_token_budget", sa.BigInteger()),
    ("monthly_spend_budget_micros", sa.BigInteger()),
    ("allowed_models", sa.JSON()),
)


def upgrade() -> None:
    op.create_table(
        "model_prices",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("input_per_mtok_micros", sa.BigInteger(), nullable=False),
        sa.Column("cached_input_per_mtok_micros", sa.BigInteger(), nullable=False),
        sa.Column("output_per_mtok_micros", sa.BigInteger(), nullable=False),
        sa.Column("effective_from", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("model", "effective_from", name="uq_model_prices_model_effective_from"),
    )
    op.create_table(
        "billing_exports",
        sa.Column("id", sa.String(length=40), nullable=False),
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("period", sa.String(length=7), nullable=False),
        sa.Column("revision", sa.Integer(), nullable=False),
        sa.Column("num_rows", sa.Integer(), nullable=False),
        sa.Column("total_cost_micros", sa.BigInteger(), nullable=False),
        sa.Column("csv_sha256", sa.String(length=64), nullable=False),
        sa.Column("jsonl_sha256", sa.String(length=64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("tenant_id", "period", "revision", name="uq_billing_exports_revision"),
    )
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.add_column(sa.Column("cost_micros", sa.BigInteger(), server_default=sa.text("0"), nullable=False))
        batch_op.add_column(sa.Column("price_id", sa.String(length=40), nullable=True))
        batch_op.add_column(sa.Column("body_purged_at", sa.DateTime(timezone=True), nullable=True))
        batch_op.create_foreign_key(
            "fk_requests_price_id_model_prices", "model_prices", ["price_id"], ["id"], ondelete="RESTRICT"
        )
        batch_op.create_index("ix_requests_finished_at", ["finished_at"], unique=False)
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        for name, kind in _KEY_LIMITS:
            batch_op.add_column(sa.Column(name, kind, nullable=True))
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("monthly_spend_budget_micros", sa.BigInteger(), nullable=True))
    _replace_usage_daily(
        [
            sa.Column("api_key_id", sa.String(length=40), server_default=sa.text("''"), nullable=False),
            sa.Column("requests", sa.Integer(), nullable=False),
            sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
            sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
            sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
            sa.Column("cost_micros", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        ],
        ["api_key_id"],
        "SELECT tenant_id, day, model, '', requests, prompt_tokens, completion_tokens, cached_tokens, 0"
        " FROM usage_daily",
    )


def _replace_usage_daily(columns: list[sa.Column], extra_key: list[str], select: str) -> None:
    """Rebuild `usage_daily` with `columns` after (tenant_id, day, model), filled by `select` from the old one:
    a new table, copied, renamed — the same on SQLite and PostgreSQL, whose primary key cannot be altered alike."""
    op.create_table(
        "usage_daily_next",
        sa.Column("tenant_id", sa.String(length=40), nullable=False),
        sa.Column("day", sa.Date(), nullable=False),
        sa.Column("model", sa.String(length=200), nullable=False),
        *columns,
        sa.ForeignKeyConstraint(["tenant_id"], ["tenants.id"], ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("tenant_id", "day", "model", *extra_key),
    )
    op.execute(f"INSERT INTO usage_daily_next {select}")
    op.drop_table("usage_daily")
    op.rename_table("usage_daily_next", "usage_daily")


def downgrade() -> None:
    """Usage of a tenant's keys merges back into one row per (tenant, day, model); costs and limits are dropped."""
    _replace_usage_daily(
        [
            sa.Column("requests", sa.Integer(), nullable=False),
            sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
            sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
            sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        ],
        [],
        "SELECT tenant_id, day, model, SUM(requests), SUM(prompt_tokens), SUM(completion_tokens),"
        " SUM(cached_tokens) FROM usage_daily GROUP BY tenant_id, day, model",
    )
    # plain DROP COLUMN (SQLite 3.35+ too): a batch would recreate these tables, and dropping the old copy
    # with foreign keys on would cascade to the rows that reference them (usage, keys, requests)
    op.execute("ALTER TABLE tenants DROP COLUMN monthly_spend_budget_micros")
    for name, _ in reversed(_KEY_LIMITS):
        op.execute(f"ALTER TABLE api_keys DROP COLUMN {name}")
    with op.batch_alter_table("requests", schema=None) as batch_op:
        batch_op.drop_index("ix_requests_finished_at")
        batch_op.drop_constraint("fk_requests_price_id_model_prices", type_="foreignkey")
        batch_op.drop_column("body_purged_at")
        batch_op.drop_column("price_id")
        batch_op.drop_column("cost_micros")
    op.drop_table("billing_exports")
    op.drop_table("model_prices")
