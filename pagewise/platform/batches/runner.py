"""Runs batches: every API process ticks through the open batches (a lifespan task), and any number of processes
may, since each step is a conditional update that only one of them wins.

A tick, per open batch: lines whose request's row is final get their result (`running` → `succeeded` |
`failed`, once); past its window the batch's pending lines expire; an `in_progress` batch has pending lines
claimed (`pending` → `running` under a fresh request id) and admitted like any request — the same preparation,
quota reservation, row and Submit, but under the batch's key with the interactive rate and concurrency limits
left out (its tenant's and key's token and dollar budgets still apply) and at the `batch` priority class — at
most `batch_lines_in_flight` (a setting) per batch and twice that per tenant; once no line is pending or
running, the batch is finalized: its output and error files written (ids derived from the batch's, so a second
writer writes the same files) and its status made final.

Crash safety: a line's request is the platform's durable request (its row, its lease, its settlement: billed
once); a process that dies after claiming a line and before its row was written leaves a `running` line with no
row, which goes back to `pending` after `CLAIM_GRACE`; a request that failed because its process stopped, having
billed nothing (the orphan sweep's or a restart's `worker_lost`), sends its line back to `pending` too, up to
`MAX_LINE_ATTEMPTS` requests per line. An engine refusing work for now (503) puts the line back.

Idle, the runner looks for open batches only every `IDLE_TICK_S` (a batch another API process created waits that
long at most for this one; its own runner takes it at once), and at once when this process creates one
(`PlatformServices.batch_created`, then `TICK_S` ticks for `WAKE_GRACE_S`, however the creating transaction's
commit and the wake-up are ordered). Each tick is a few database round trips, and an idle server ticking four
times a second took the cores from an engine beside it often enough to slow it by 7% (a 2-core AMX Xeon,
docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
from collections import Counter
from contextlib import suppress
from functools import partial

import anyio
import msgspec
from sqlalchemy import func, select, update

from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.limits import PRIORITY_CLASSES
from pagewise.platform.batches.results import finished_result, refused_result
from pagewise.platform.batches.service import OPEN_STATUSES, mark_unrun, prepare_line
from pagewise.platform.db.models import UNFINISHED_STATUSES, Batch, BatchLine, RequestRecord, StoredFile, as_utc, utcnow
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.files.storage import FileStorage
from pagewise.platform.inference.job import InferenceJob, new_request_id
from pagewise.platform.keys.auth import Principal, principal_of_key, unauthorized
from pagewise.platform.quotas.quota_store import KeyQuota
from pagewise.platform.services import PlatformServices
from pagewise.serving.protocol import ErrorCode, RequestStatus

logger = logging.getLogger(__name__)
CLAIM_GRACE = dt.timedelta(seconds=60)
TICK_S = 0.25
IDLE_TICK_S = 5.0
WAKE_GRACE_S = 2.0
MAX_LINE_ATTEMPTS = 3
_LOST = (ErrorCode.WORKER_LOST, ErrorCode.ENGINE_UNAVAILABLE, ErrorCode.QUEUE_TIMEOUT)
_ENDPOINTS = {"/v1/chat/completions": "chat.completions", "/v1/completions": "completions"}


async def keep_running_batches(
    services: PlatformServices, tick_s: float = TICK_S, idle_tick_s: float = IDLE_TICK_S
) -> None:
    """Tick until cancelled: every `tick_s` while a batch is open or within `WAKE_GRACE_S` of a wake-up, else
    every `idle_tick_s` or at the next wake-up. A failed tick is logged and the next one comes after `tick_s`."""
    loop = asyncio.get_running_loop()
    busy_until = 0.0
    while True:
        services.batch_created.clear()  # before the tick: a batch created during it ends the idle wait at once
        try:
            busy = await run_batches_once(services)
        except Exception:
            logger.exception("a batch runner tick failed")
            busy = True
        if busy or loop.time() < busy_until:
            await asyncio.sleep(tick_s)
            continue
        with suppress(TimeoutError):
            await asyncio.wait_for(services.batch_created.wait(), idle_tick_s)
            busy_until = loop.time() + WAKE_GRACE_S


async def run_batches_once(services: PlatformServices) -> bool:
    """One tick over the open batches; whether there were any."""
    async with services.sessionmaker() as session:
        batches = list(await session.scalars(select(Batch).where(Batch.status.in_(OPEN_STATUSES)).order_by(Batch.id)))
        if not batches:  # the idle tick: one query
            return False
        running = Counter(
            dict(
                (await session.execute(
                    select(Batch.tenant_id, func.count())
                    .join(BatchLine, BatchLine.batch_id == Batch.id)
                    .where(BatchLine.status == "running")
                    .group_by(Batch.tenant_id)
                )).all()
            )
        )
    for batch in batches:
        await _settle(services, batch)
        if batch.status == "in_progress" and batch.expired_at is None and utcnow() >= as_utc(batch.expires_at):
            await _expire(services, batch)
        elif batch.status == "in_progress" and batch.expired_at is None:
            room = 2 * services.settings.batch_lines_in_flight - running[batch.tenant_id]
            running[batch.tenant_id] += await _dispatch(services, batch, room)
        await _finalize(services, batch)
    return True


async def _settle(services: PlatformServices, batch: Batch) -> None:
    """Give every running line whose request's row is final its result; free claims that never became a row."""
    async with services.sessionmaker() as session:
        running = select(BatchLine).where(BatchLine.batch_id == batch.id, BatchLine.status == "running")
        lines = list(await session.scalars(running))
        if not lines:
            return
        ids = [line.request_id for line in lines]
        rows = {row.id: row for row in await session.scalars(select(RequestRecord).where(RequestRecord.id.in_(ids)))}
        now = utcnow()
        for line in lines:
            row = rows.get(line.request_id)
            if row is None:
                if line.claimed_at is not None and now - as_utc(line.claimed_at) > CLAIM_GRACE:
                    await session.execute(_running(line).values(status="pending", request_id=None, claimed_at=None))
                continue
            if row.status in UNFINISHED_STATUSES:
                continue
            if _lost_unbilled(row) and line.attempts < MAX_LINE_ATTEMPTS:
                await session.execute(_running(line).values(status="pending", request_id=None, claimed_at=None))
                continue
            succeeded, result = finished_result(line, row)
            await session.execute(_running(line).values(status="succeeded" if succeeded else "failed", result=result))
        await session.commit()


def _lost_unbilled(row: RequestRecord) -> bool:
    """A request that failed because its process stopped, having billed nothing: its line may run again."""
    return (
        row.status == RequestStatus.FAILED
        and row.error_code in _LOST
        and row.prompt_tokens == row.completion_tokens == 0
        and row.cost_micros == 0
    )


def _pending(line: BatchLine):
    """An update of `line` that applies only while it is still pending (one process claims it)."""
    return update(BatchLine).where(
        BatchLine.batch_id == line.batch_id, BatchLine.custom_id == line.custom_id, BatchLine.status == "pending"
    )


def _running(line: BatchLine):
    """An update of `line` that applies only while it is still running under the same request."""
    return update(BatchLine).where(
        BatchLine.batch_id == line.batch_id,
        BatchLine.custom_id == line.custom_id,
        BatchLine.status == "running",
        BatchLine.request_id == line.request_id,
    )


async def _expire(services: PlatformServices, batch: Batch) -> None:
    async with services.sessionmaker() as session:
        won = await session.execute(
            update(Batch).where(Batch.id == batch.id, Batch.expired_at.is_(None)).values(expired_at=utcnow())
        )
        if won.rowcount:
            await mark_unrun(session, batch.id, "expired", "batch_expired", "the batch's completion window ended first")
        await session.commit()


def batch_principal(principal: Principal) -> Principal:
    """The principal a batch's lines run under: no interactive rate or concurrency limits (a batch has its own caps),
    the budgets kept, and never better than the `batch` priority class."""
    limits = msgspec.structs.replace(
        principal.limits, requests_per_minute=None, tokens_per_minute=None, max_concurrent_requests=None
    )
    key = principal.key_quota
    if key is not None:
        budgets = msgspec.structs.replace(key.limits, requests_per_minute=None, tokens_per_minute=None)
        key = KeyQuota(key.key_id, budgets)
    floor = max(principal.priority_floor, PRIORITY_CLASSES["batch"])
    return msgspec.structs.replace(principal, limits=limits, key_quota=key, priority_floor=floor)


async def _dispatch(services: PlatformServices, batch: Batch, tenant_room: int) -> int:
    """Claim and admit pending lines, as room allows; how many were handed over."""
    async with services.sessionmaker() as session:
        running = await session.scalar(
            select(func.count()).where(BatchLine.batch_id == batch.id, BatchLine.status == "running")
        )
        room = min(services.settings.batch_lines_in_flight - (running or 0), tenant_room)
        if room <= 0:
            return 0
        pending = list(
            await session.scalars(
                select(BatchLine)
                .where(BatchLine.batch_id == batch.id, BatchLine.status == "pending")
                .order_by(BatchLine.line)
                .limit(room)
            )
        )
    if not pending:
        return 0
    try:
        if batch.api_key_id is None:
            raise unauthorized("The API key that made this batch no longer exists")
        principal = batch_principal(await services.database.run(partial(principal_of_key, batch.api_key_id)))
    except APIError as error:
        for line in pending:
            await _claim_and_fail(services, line, error)
        return 0
    handed = 0
    for line in pending:
        outcome = await _run_line(services, batch, line, principal)
        if outcome is None:
            break  # no engine takes work now: the rest waits for the next tick
        handed += outcome
    return handed


async def _run_line(services: PlatformServices, batch: Batch, line: BatchLine, principal: Principal) -> int | None:
    """Claim `line` and admit its request: 1 handed over, 0 not (claimed elsewhere, or refused: its result is
    recorded), None when the engine refuses work for now (the line is pending again)."""
    request_id = new_request_id(_ENDPOINTS[batch.endpoint])
    async with services.sessionmaker() as session:
        claimed = await session.execute(
            _pending(line).values(
                status="running", request_id=request_id, claimed_at=utcnow(), attempts=BatchLine.attempts + 1
            )
        )
        await session.commit()
    if not claimed.rowcount:
        return 0
    line.request_id = request_id
    try:
        prepared = await prepare_line(batch.endpoint, line.body, principal, services.engine)
        await InferenceJob.admit(services, principal, prepared, request_id=request_id, batch_id=batch.id)
    except (APIError, InvalidRequestError) as exc:
        error = exc if isinstance(exc, APIError) else invalid_request(str(exc), param=exc.param)
        if error.status_code == 503:
            await _write(services, _running(line).values(status="pending", request_id=None, claimed_at=None))
            return None
        await _write(services, _running(line).values(status="failed", result=refused_result(line, error)))
        return 0
    return 1


async def _claim_and_fail(services: PlatformServices, line: BatchLine, error: APIError) -> None:
    await _write(services, _pending(line).values(status="failed", result=refused_result(line, error)))


async def _write(services: PlatformServices, statement) -> None:
    async with services.sessionmaker() as session:
        await session.execute(statement)
        await session.commit()


def _file_ids(batch_id: str) -> tuple[str, str]:
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-out", f"file-{suffix}-err"


async def _finalize(services: PlatformServices, batch: Batch) -> None:
    """Once no line is pending or running: write the output and error files, make the status final."""
    async with services.sessionmaker() as session:
        current = await session.get(Batch, batch.id)
        if current is None or current.status not in OPEN_STATUSES:
            return
        unfinished = await session.scalar(
            select(func.count()).where(BatchLine.batch_id == batch.id, BatchLine.status.in_(("pending", "running")))
        )
        if unfinished:
            return
        if current.status != "finalizing":
            won = await session.execute(
                update(Batch)
                .where(Batch.id == batch.id, Batch.status == current.status)
                .values(status="finalizing", finalizing_at=utcnow())
            )
            await session.commit()
            if not won.rowcount:
                return
            await session.refresh(current)
        of_batch = select(BatchLine).where(BatchLine.batch_id == batch.id)
        lines = list(await session.scalars(of_batch.order_by(BatchLine.line)))
        output = [line.result for line in lines if line.status == "succeeded"]
        errors = [line.result for line in lines if line.status != "succeeded"]
        output_id, error_id = _file_ids(batch.id)
        storage = FileStorage(services.settings.files_path)
        current.output_file_id = await _write_file(session, storage, current, output_id, "output", output)
        current.error_file_id = await _write_file(session, storage, current, error_id, "error", errors)
        now = utcnow()
        if current.cancelling_at is not None:
            current.status, current.cancelled_at = "cancelled", now
        elif current.expired_at is not None:
            current.status = "expired"
        else:
            current.status, current.completed_at = "completed", now
        await session.commit()


async def _write_file(
    session, storage: FileStorage, batch: Batch, file_id: str, kind: str, results: list
) -> str | None:
    """The batch's output or error file (None when it has no line); the same id and bytes however often written."""
    if not results:
        return None
    content = "".join(msgspec.json.encode(r).decode() + "\n" for r in results).encode()
    await anyio.to_thread.run_sync(storage.write, batch.tenant_id, file_id, content)
    if await session.get(StoredFile, file_id) is None:
        session.add(
            StoredFile(
                id=file_id,
                tenant_id=batch.tenant_id,
                api_key_id=batch.api_key_id,
                purpose="batch_output",
                filename=f"{batch.id}_{kind}.jsonl",
                bytes=len(content),
                line_count=len(results),
                sha256=hashlib.sha256(content).hexdigest(),
                created_at=utcnow(),
            )
        )
    return file_id
