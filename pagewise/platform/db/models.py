"""The schema. Alembic migrations (`db/migrations/`) create it; a test proves they match these models exactly."""

from __future__ import annotations

import datetime as dt
import enum
from typing import Any

from sqlalchemy import JSON, BigInteger, Date, DateTime, Float, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def as_utc(value: dt.datetime) -> dt.datetime:
    """SQLite hands back naive datetimes; everything stored is UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=dt.UTC)


class RequestStatus(enum.StrEnum):
    """A request row's status: `queued` → `running` → one terminal status, never changed afterwards."""

    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


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
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow, onupdate=utcnow)


class ApiKey(Base):
    """An API key. Only `prefix` and the SHA-256 of the secret are stored; the key itself is shown once."""

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


class RequestRecord(Base):
    """One API request (sync, streamed or async). Written on accept, on first token and on finish only
    (plus lease renewals). Listings run newest first on `(queued_at, id)`, a total order an index serves.

    `lease_expires_at` is `None` for rows owned by an embedded (single-process) server; otherwise an
    unfinished row whose lease has passed lost its process and is failed by the orphan sweep.
    """

    __tablename__ = "requests"
    __table_args__ = (
        Index("ix_requests_tenant_id_queued_at_id", "tenant_id", "queued_at", "id"),
        Index("ix_requests_status", "status"),
        Index("ix_requests_queued_at", "queued_at"),
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
    error: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    started_at: Mapped[dt.datetime | None]
    first_token_at: Mapped[dt.datetime | None]
    finished_at: Mapped[dt.datetime | None]
    lease_expires_at: Mapped[dt.datetime | None]


class UsageDaily(Base):
    """Per tenant, model and UTC day: requests and tokens; updated in the transaction finishing a request."""

    __tablename__ = "usage_daily"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    day: Mapped[dt.date] = mapped_column(Date, primary_key=True)
    model: Mapped[str] = mapped_column(String(200), primary_key=True)
    requests: Mapped[int] = mapped_column(default=0)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    completion_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
