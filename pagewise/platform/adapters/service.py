"""Tenants' adapters: register (check, store, record), look up, delete, and resolve a request's model name.

Invariants:
- Every query starts from `tenant_adapters(tenant_id)`: another tenant's adapter, and a deleted one, answer exactly
  as one that never existed (404, never listed, never usable).
- An upload is checked whole before anything is stored — its name, its size, and its files against the base
  model as the engines published it (`EngineInfo.adapters`: the architecture and the largest rank), with the very
  function a worker loads it with (`adapter_files.parse_adapter`) — so a refused upload leaves no row and no file.
- Files are written (content-addressed, `serving/adapter_store.py`) before the row; the row is the adapter. A
  digest's files are written and a row using them committed, or its users counted and its files removed, under
  the digest's store lock: deleting one tenant's adapter never removes the files another tenant's upload of the
  same bytes has just recorded.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
from litestar.datastructures import UploadFile
from sqlalchemy import Select, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.engine.adapter_files import AdapterError, parse_adapter
from pagewise.platform.adapters.schemas import model_name
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import Adapter, utcnow
from pagewise.platform.errors import APIError, invalid_request, not_found
from pagewise.platform.inference.prompts import model_not_found
from pagewise.platform.services import PlatformServices
from pagewise.serving.adapter_store import AdapterStore
from pagewise.serving.protocol import AdapterRef

ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
MAX_CONFIG_BYTES = 2**20  # an adapter_config.json is a few hundred bytes


@dataclass
class AdapterUpload:
    """`POST /v1/adapters` (multipart): PEFT's two files, the name requests will use, and the base model (default:
    the model this server serves)."""

    name: str
    config: UploadFile  # adapter_config.json
    weights: UploadFile  # adapter_model.safetensors
    model: str | None = None


def tenant_adapters(tenant_id: str) -> Select[tuple[Adapter]]:
    """Every query for a tenant's adapters starts here: another tenant's, and deleted ones, are never visible."""
    return select(Adapter).where(Adapter.tenant_id == tenant_id, Adapter.deleted_at.is_(None))


async def get_adapter(session: AsyncSession, tenant_id: str, adapter_id: str) -> Adapter:
    row = await session.scalar(tenant_adapters(tenant_id).where(Adapter.id == adapter_id))
    if row is None:
        raise not_found("adapter", adapter_id)
    return row


def adapter_store(services: PlatformServices) -> AdapterStore:
    return AdapterStore(services.settings.adapters_path)


async def register_adapter(
    session: AsyncSession, services: PlatformServices, tenant_id: str, upload: AdapterUpload
) -> Adapter:
    """Check `upload` whole, store its files, record it for `tenant_id`; a 400 naming the problem (nothing stored),
    or a 409 when the tenant already has an adapter of that name."""
    engine = services.engine
    name = upload.name.strip() if isinstance(upload.name, str) else ""
    if not ADAPTER_NAME.fullmatch(name):
        raise invalid_request(
            "name must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit; got "
            f"{upload.name!r}",
            param="name",
        )
    base = engine.model_name if upload.model is None else upload.model
    if base not in engine.model_names:
        raise invalid_request(f"model {base!r} is not served here; adapters here are for {engine.model_name!r}",
                              param="model")
    support = engine.info.adapters
    if support is None:
        raise invalid_request("this server serves no adapters: its engines run without --enable-lora", param="model")
    config, weights = await upload.config.read(), await upload.weights.read()
    limit = services.settings.max_adapter_bytes
    if len(config) + len(weights) > limit:
        raise invalid_request(
            f"the adapter is {len(config) + len(weights):,} bytes; at most {limit:,} are allowed", param="weights"
        )
    if len(config) > MAX_CONFIG_BYTES:
        raise invalid_request(f"adapter_config.json is {len(config):,} bytes; at most {MAX_CONFIG_BYTES:,}",
                              param="config")
    try:
        checked = await anyio.to_thread.run_sync(parse_adapter, config, weights, support.arch, support.max_lora_rank)
    except AdapterError as error:
        raise invalid_request(f"invalid adapter: {error}", param="weights", code="invalid_adapter") from None
    if await session.scalar(tenant_adapters(tenant_id).where(Adapter.name == name)) is not None:
        raise _name_taken(name)
    store = adapter_store(services)
    async with _digest_locked(store, checked.digest):
        await anyio.to_thread.run_sync(store.write, checked.digest, config, weights)
        row = Adapter(
            id=new_id("adapter", separator="-"),
            tenant_id=tenant_id,
            name=name,
            base_model=engine.model_name,
            digest=checked.digest,
            rank=checked.rank,
            target_modules=list(checked.targets),
            bytes=len(config) + len(weights),
            status="active",
            created_at=utcnow(),
        )
        session.add(row)
        try:
            await session.commit()
        except IntegrityError:
            await session.rollback()
            await _drop_unused_files(session, store, checked.digest)
            raise _name_taken(name) from None
        except BaseException:
            await session.rollback()
            await _drop_unused_files(session, store, checked.digest)
            raise
    return row


def _name_taken(name: str) -> APIError:
    return APIError(409, f"you already have an adapter named {name!r}", code="adapter_exists", param="name")


async def delete_adapter(session: AsyncSession, services: PlatformServices, row: Adapter) -> None:
    """Delete `row`: gone from listings and lookups now; its files once no adapter uses their digest."""
    row.deleted_at = utcnow()
    await session.commit()
    store = adapter_store(services)
    async with _digest_locked(store, row.digest):
        await _drop_unused_files(session, store, row.digest)


@asynccontextmanager
async def _digest_locked(store: AdapterStore, digest: str) -> AsyncIterator[None]:
    """Hold `digest`'s store lock (`AdapterStore.lock`) for the block: writing its files and committing a row that
    uses them, or counting its users and removing them, happen one at a time across requests and replicas."""
    fd = await anyio.to_thread.run_sync(store.lock, digest)
    try:
        yield
    finally:
        os.close(fd)


async def _drop_unused_files(session: AsyncSession, store: AdapterStore, digest: str) -> None:
    """Remove `digest`'s files if no live adapter uses them (the caller holds the digest's lock)."""
    users = select(func.count()).select_from(Adapter).where(Adapter.digest == digest, Adapter.deleted_at.is_(None))
    if not await session.scalar(users):
        await anyio.to_thread.run_sync(store.delete, digest)


async def resolve_adapter(services: PlatformServices, tenant_id: str, model: str) -> AdapterRef | None:
    """The adapter a request's `model` names (`<base>:<adapter name>`, the base under any of its served names), or
    None for the base model itself. An adapter the caller's tenant does not have is a 404, exactly like a model
    that does not exist; a disabled one a 400."""
    base, colon, name = model.partition(":")
    if not colon:
        return None
    engine = services.engine
    if base not in engine.model_names:
        raise model_not_found(model, engine)
    async with services.sessionmaker() as session:
        row = await session.scalar(
            tenant_adapters(tenant_id).where(Adapter.name == name, Adapter.base_model == engine.model_name)
        )
    if row is None:
        raise model_not_found(model, engine)
    if row.status != "active":
        raise invalid_request(
            f"adapter {model_name(row.base_model, row.name)!r} is disabled; enable it with PATCH /v1/adapters/{row.id}",
            param="model",
            code="adapter_disabled",
        )
    return AdapterRef(row.id, row.name, row.digest)
