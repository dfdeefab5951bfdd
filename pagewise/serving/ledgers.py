"""The serving core's two ledgers, as interfaces: where a request's final state is written (`RequestLedger`) and
where its quota reservation is settled (`QuotaLedger`). The platform implements them over SQLAlchemy
(`platform/requests/store.py`) and over Redis or process memory (`platform/quotas/`); the core — `EngineHost`,
`Execution`, the Redis worker — knows only these.

Invariants every implementation keeps (their tests: `tests/integration/requests/`, `tests/integration/quotas/`):
- `RequestLedger.finish` is the final write, guarded on an unfinished row: it returns what it billed (`Billed`)
  when this call finished the row, `None` when the row was already terminal — then nothing changes. A request is
  billed once, whoever finishes it.
- `QuotaLedger.reconcile` acts once per reservation: True the first time, False after (or once its lease ran out).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Collection
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import msgspec

from pagewise.serving.protocol import ErrorInfo, Finished, RequestStatus, Reservation, Submit, Usage

if TYPE_CHECKING:
    from redis.asyncio.client import Pipeline


class FinishedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Everything a request's final write records."""

    status: RequestStatus
    output: list[dict[str, Any]]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    error: ErrorInfo | None  # set on a failed request only: our code and a public message (the cause is logged)
    started_at: dt.datetime | None
    first_token_at: dt.datetime | None
    finished_at: dt.datetime

    @property
    def usage(self) -> Usage:
        return Usage(
            prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens
        )

    @classmethod
    def failed(cls, error: ErrorInfo) -> FinishedRequest:
        """A request that never ran: failed now with `error`, nothing produced, nothing billed."""
        return cls(
            status=RequestStatus.FAILED,
            output=[],
            finish_reason=None,
            prompt_tokens=0,
            completion_tokens=0,
            cached_tokens=0,
            error=error,
            started_at=None,
            first_token_at=None,
            finished_at=dt.datetime.now(dt.UTC),
        )


class Billed(msgspec.Struct, frozen=True):
    """What the final write that finished a row billed: the row's `cost_micros`."""

    cost_micros: int


def finished_event(final: FinishedRequest, attempt: int) -> Finished:
    """The `Finished` message a final row stands for."""
    return Finished(
        attempt=attempt,
        status=final.status,
        usage=final.usage,
        error=final.error if final.status == RequestStatus.FAILED else None,
        started_at=None if final.started_at is None else final.started_at.timestamp(),
        first_token_at=None if final.first_token_at is None else final.first_token_at.timestamp(),
        finished_at=final.finished_at.timestamp(),
    )


class RequestLedger(Protocol):
    """The requests' rows, as the engine's side writes them."""

    async def mark_running(self, request_id: str, started_at: dt.datetime, first_token_at: dt.datetime) -> None:
        """The row's first token: `queued` → `running` (a row no longer queued is left as it is)."""
        ...

    async def finish(
        self,
        request_id: str,
        tenant_id: str,
        model: str,
        result: FinishedRequest,
        *,
        price_models: tuple[str, ...] | None = None,
    ) -> Billed | None:
        """The guarded final write, its cost and the day's usage (under `model`) together (see the module's
        invariants); priced by the first of `price_models` (default: `model`) that has a price in effect."""
        ...

    async def final_state(self, request_id: str) -> FinishedRequest | None:
        """What the row's final write recorded, or `None` while it is unfinished (or missing)."""
        ...

    async def renew_leases(self, request_ids: Collection[str], until: dt.datetime) -> None:
        """Extend the lease of the unfinished rows among `request_ids` to `until`."""
        ...

    def is_unreachable(self, error: BaseException) -> bool:
        """Whether `error`, raised by one of these calls, means the ledger's store is out of reach for now (worth
        retrying) rather than a bug."""
        ...


class QuotaLedger(Protocol):
    """The quota reservations, as the engine's side settles them (`platform/quotas/quota_store.py` has the
    semantics; admission, which takes them, is the API's)."""

    lease_s: float
    """How long a reservation holds its slots without `renew`."""

    async def renew(self, reservation: Reservation) -> bool:
        """Extend a live lease by a full lease from now; False if it was reconciled or has expired."""
        ...

    async def reconcile(self, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None) -> bool:
        """Release the reservation's slots and replace what it reserved by what the request used (and was billed:
        `actual_cost` micro-dollars); once per reservation."""
        ...


@runtime_checkable
class PipelinedQuotaLedger(QuotaLedger, Protocol):
    """A quota ledger kept in Redis, whose reconcile can ride in a caller's transaction: the Redis worker queues
    it before a settlement's terminal event, so no reader sees the event before the reconcile."""

    def queue_reconcile(
        self, pipe: Pipeline, reservation: Reservation, actual_tokens: int, actual_cost: int | None = None
    ) -> None:
        """Queue `reconcile` on `pipe` (a pipeline to this ledger's Redis); its reply (1: reconciled now, 0:
        already) is the pipeline's at that place."""
        ...


class SettlementObserver(Protocol):
    """Counts settled requests (the platform's metrics): told once per request, by the host whose final write it
    was."""

    def observe_settled(self, submit: Submit, finished: Finished) -> None: ...
