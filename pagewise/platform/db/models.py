"""The schema. Alembic migrations (`db/migrations/`) create it; a test proves they match these models exactly."""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Date,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from pagewise.serving.protocol import RequestStatus


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes; everything stored is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


UNFINISHED_STATUSES = (RequestStatus.QUEUED, RequestStatus.RUNNING)
"""The statuses a row may still leave; every final write is guarded on them."""


class Base(DeclarativeBase):
    type_annotation_map = {dt.datetime: DateTime(timezone=True), dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    """A customer. Quota columns are `None` for "no limit"; `weight` (never null, > 0) is its scheduling tier."""

    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    status: Mapped[str] = mapped_column(String(16), default="active")  # active | suspended
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent_requests: Mapped[int | None] = mapped_column(Integer)
    max_tokens_per_request: Mapped[int | None] = mapped_column(Integer)
    max_n: Mapped[int | None] = mapped_column(Integer)
    weight: Mapped[float] = mapped_column(Float, default=1.0, server_default=text("1.0"))
    monthly_spend_budget_micros: Mapped[int | None] = mapped_column(BigInteger)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    """An API key. Only `prefix` and the SHA-256 of the secret are stored; the key itself is shown once.

    Its limits (`None`: none of its own) apply on top of its tenant's; `allowed_models` `None` allows every model;
    `priority_class` (`None`: `interactive`) is the best priority class its requests may run at (`PRIORITY_CLASSES`).
    """

    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(200), default="")
    prefix: Mapped[str] = mapped_column(String(16), unique=True)
    secret_sha256: Mapped[str] = mapped_column(String(64))
    scopes: Mapped[list[Any]] = mapped_column(default=list)
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    last_used_at: Mapped[dt.datetime | None]
    expires_at: Mapped[dt.datetime | None]
    revoked_at: Mapped[dt.datetime | None]
    requests_per_minute: Mapped[int | None] = mapped_column(Integer)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer)
    monthly_token_budget: Mapped[int | None] = mapped_column(BigInteger)
    monthly_spend_budget_micros: Mapped[int | None] = mapped_column(BigInteger)
    allowed_models: Mapped[list[Any] | None]
    priority_class: Mapped[str | None] = mapped_column(String(16))
    # the first key of this key's rotations (None: this key is the first): its monthly budget counters, which
    # every key of the lineage shares, are kept and rebuilt under that id (`budget_scope_id`)
    budget_key_id: Mapped[str | None] = mapped_column(String(40), index=True)


class RequestRecord(Base):
    """One API request (sync, streamed or async). Written on accept, on first token and on finish only
    (plus lease renewals). Listings run newest first on `(queued_at, id)`, a total order an index serves.

    `lease_expires_at` is `None` for rows owned by an embedded (single-process) server; otherwise an
    unfinished row whose lease has passed lost its process and is failed by the orphan sweep.

    `cost_micros` is set by the final write from the price in effect at `finished_at` (`price_id`; `None`: the
    model had no price, and the request cost 0). `body_purged_at` is set when retention dropped `input` and
    `output`; tokens and cost stay.
    """

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_tenant_id_queued_at_id", "tenant_id", "queued_at", "id"),
        Index("ix_requests_status", "status"),
        Index("ix_requests_queued_at", "queued_at"),
        Index("ix_requests_finished_at", "finished_at"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    endpoint: Mapped[str] = mapped_column(String(32))  # chat.completions | completions
    model: Mapped[str] = mapped_column(String(200))
    input: Mapped[dict[str, Any]]  # {"messages": [...]} or {"prompt": ...}
    params: Mapped[dict[str, Any]]  # sampling parameters as sent to the engine
    status: Mapped[str] = mapped_column(String(16), default=RequestStatus.QUEUED.value)  # a RequestStatus
    output: Mapped[list[Any] | None]  # [{"index", "text", "finish_reason"}, ...]
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    prompt_tokens: Mapped[int] = mapped_column(default=0)
    completion_tokens: Mapped[int] = mapped_column(default=0)
    cached_tokens: Mapped[int] = mapped_column(default=0)
    error_code: Mapped[str | None] = mapped_column(String(32))  # an ErrorCode, on a failed row only
    error: Mapped[str | None] = mapped_column(Text)  # with `error_code`: its public message
    queued_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    first_token_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    lease_expires_at: Mapped[dt.datetime | None]
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    price_id: Mapped[str | None] = mapped_column(ForeignKey("model_prices.id", ondelete="RESTRICT"))
    body_purged_at: Mapped[dt.datetime | None]
    trace_id: Mapped[str | None] = mapped_column(String(32))  # the request's OpenTelemetry trace, when traced
    # what admission reserved (tokens, micro-dollars): a month rebuilt from the database counts an unfinished
    # request at this, since its reservation may be gone with Redis's data and its usage is not billed yet
    reserved_tokens: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    reserved_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))
    batch_id: Mapped[str | None] = mapped_column(String(40))  # the batch it is a line of (priced at the batch rate)


class UsageDaily(Base):
    """Per tenant, UTC day, model, API key and batch: requests, tokens and cost; updated in the transaction finishing a
    request, so it is the one source of truth for usage (the roll-up jobs only check it against the rows).

    `api_key_id` is part of the key, so usage groups by key without reading request rows. It is `""` for
    usage recorded before keys were tracked (revision 0004) and for requests whose key is gone; never null,
    since it is part of the primary key.
    """

    __tablename__ = "usage_daily"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    api_key_id: Mapped[str] = mapped_column(String(40), primary_key=True, server_default=text("''"))
    batch_id: Mapped[str] = mapped_column(String(40), primary_key=True, server_default=text("''"))  # "": interactive
    requests: Mapped[int] = mapped_column(default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cost_micros: Mapped[int] = mapped_column(BigInteger, default=0, server_default=text("0"))


class ModelPrice(Base):
    """One version of a model's price, in integer micro-dollars per million tokens, from `effective_from` on.

    Rows are only ever added: the price in effect at a moment is the row of that model with the latest
    `effective_from` not after it, so a new price never changes what was billed before it.
    """

    __tablename__ = "model_prices"
    __table_args__ = (UniqueConstraint("model", "effective_from", name="uq_model_prices_model_effective_from"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    model: Mapped[str] = mapped_column(String(200))
    input_per_mtok_micros: Mapped[int] = mapped_column(BigInteger)
    cached_input_per_mtok_micros: Mapped[int] = mapped_column(BigInteger)
    output_per_mtok_micros: Mapped[int] = mapped_column(BigInteger)
    batch_percent: Mapped[int] = mapped_column(Integer, default=50, server_default=text("50"))  # a batch line's share
    effective_from: Mapped[dt.datetime]
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class BillingExport(Base):
    """One revision of a tenant's billing export for a calendar month (`period`, `YYYY-MM`).

    Revisions of a (tenant, period) count up from 1 and differ in content: an export whose files would hash
    the same as the latest revision's is that revision. The files live under the export directory at
    `<tenant_id>/<period>/r<revision>.{csv,jsonl}`.
    """

    __tablename__ = "billing_exports"
    __table_args__ = (UniqueConstraint("tenant_id", "period", "revision", name="uq_billing_exports_revision"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    period: Mapped[str] = mapped_column(String(7))
    revision: Mapped[int] = mapped_column(Integer)
    num_rows: Mapped[int] = mapped_column(Integer)
    total_cost_micros: Mapped[int] = mapped_column(BigInteger)
    csv_sha256: Mapped[str] = mapped_column(String(64))
    jsonl_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class StoredFile(Base):
    """A tenant's uploaded file (OpenAI's Files API; `purpose` `batch` only). Its bytes live in the file store
    (`files/storage.py`) under its tenant and id, with their SHA-256; the row is written only once they are there.
    `deleted_at` is set when it is deleted: its bytes are removed, the row stays (a batch naming it is refused as
    deleted, not as unknown). Listings run newest first on `(created_at, id)`."""

    __tablename__ = "files"
    __table_args__ = (Index("ix_files_tenant_id_created_at_id", "tenant_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    purpose: Mapped[str] = mapped_column(String(32))
    filename: Mapped[str] = mapped_column(String(256))
    bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[dt.datetime | None]


class Batch(Base):
    """A tenant's batch (OpenAI's Batch API): the requests of an input file, run at the `batch` priority class in
    the engines' spare capacity and priced at the batch rate. Its lines are `BatchLine`s; its request counts are
    read from them. `status` is OpenAI's: `in_progress` → `finalizing` → `completed`, or `cancelling` →
    `finalizing` → `cancelled`, or (the window passed: `expired_at` set) → `finalizing` → `expired`. The output
    and error files' ids are made from the batch's, so writing them again writes the same files."""

    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_tenant_id_id", "tenant_id", "id"), Index("ix_batches_status", "status"))

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    api_key_id: Mapped[str | None] = mapped_column(ForeignKey("api_keys.id", ondelete="SET NULL"))
    input_file_id: Mapped[str] = mapped_column(ForeignKey("files.id", ondelete="CASCADE"))
    endpoint: Mapped[str] = mapped_column(String(32))
    completion_window: Mapped[str] = mapped_column(String(8))
    batch_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata")
    status: Mapped[str] = mapped_column(String(16))
    output_file_id: Mapped[str | None] = mapped_column(String(40))
    error_file_id: Mapped[str | None] = mapped_column(String(40))
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    in_progress_at: Mapped[dt.datetime | None]
    expires_at: Mapped[dt.datetime]
    finalizing_at: Mapped[dt.datetime | None]
    completed_at: Mapped[dt.datetime | None]
    expired_at: Mapped[dt.datetime | None]
    cancelling_at: Mapped[dt.datetime | None]
    cancelled_at: Mapped[dt.datetime | None]


class BatchLine(Base):
    """One request of a batch, keyed by (batch, custom_id): `pending` → `running` (claimed: `request_id` names the
    request it runs as) → `succeeded` | `failed`; or `cancelled` / `expired` before it ran; or back to `pending`
    when its request was lost with its process before anything was billed (`attempts` bounds that). `result` is
    its line of the output or error file, written once, when its request's row is final."""

    __tablename__ = "batch_lines"
    __table_args__ = (Index("ix_batch_lines_batch_id_status_line", "batch_id", "status", "line"),)

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    custom_id: Mapped[str] = mapped_column(String(512), primary_key=True)
    line: Mapped[int] = mapped_column(Integer)
    body: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    request_id: Mapped[str | None] = mapped_column(String(40))
    claimed_at: Mapped[dt.datetime | None]
    attempts: Mapped[int] = mapped_column(default=0)  # requests it was handed over as
    result: Mapped[dict[str, Any] | None]


class Adapter(Base):
    """A tenant's LoRA adapter for the base model `base_model` (its listed name), requested as
    `<base_model>:<name>`. Its files live in the adapter store (`serving/adapter_store.py`) under `digest`, their
    content address; the row is written only once they are there and passed every check against the base model.

    `name` is unique among a tenant's adapters not deleted (a partial unique index); `status` is `active` or
    `disabled` (a disabled adapter is listed but refuses requests). `deleted_at` is set when it is deleted: it is
    gone from every listing and lookup; its usage rows stay, and its files are removed once no adapter row uses
    their digest. Another tenant's adapter is never visible (`adapters/service.py` `tenant_adapters`)."""

    __tablename__ = "adapters"
    __table_args__ = (
        Index(
            "uq_adapters_tenant_id_name",
            "tenant_id",
            "name",
            unique=True,
            sqlite_where=text("deleted_at IS NULL"),
            postgresql_where=text("deleted_at IS NULL"),
        ),
        Index("ix_adapters_digest", "digest"),
    )

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    name: Mapped[str] = mapped_column(String(64))
    base_model: Mapped[str] = mapped_column(String(200))
    digest: Mapped[str] = mapped_column(String(64))
    rank: Mapped[int] = mapped_column(Integer)
    target_modules: Mapped[list[Any]]
    bytes: Mapped[int] = mapped_column(BigInteger)
    status: Mapped[str] = mapped_column(String(16), default="active")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    deleted_at: Mapped[dt.datetime | None]
