"""One admitted inference request, as the API sees it: admission, handing it to an engine, reading its events.

Invariants:
- Admission changes nothing unless it succeeds whole: engine capacity is checked first (503), quota is reserved
  second (400 if it can never fit, 429 when refused now), the `queued` row is written third, and the Submit is
  handed to an engine last. If the row or the hand-over fails, the reservation is released (and the row, if
  written, failed), so there is never a reservation without a row nor a row that no engine will ever finish.
- The engine's side owns the request from then on: it writes the final row, the day's usage and the quota
  reconciliation exactly once (`pagewise.serving.execution`). This side only reads the request's events, and
  aborts the request when its reader goes away before the end (a client hanging up, even before the first
  chunk; shutdown) — the engine then bills what it computed and ends the row `cancelled`.
- A reader never hangs: when no event arrives for `STALL_S`, the row is consulted; a final row ends the read.
- A request restarted on another worker (a higher `attempt`) continues cleanly when its output is reproducible
  (greedy or seeded): the tokens the client already has are skipped. A sampled one ends with a `worker_lost`
  error instead, since its continuation would not match what was sent. Once a higher attempt is seen, events of
  lower ones (a stalled worker that woke up before it learnt it was superseded) are ignored: two attempts never
  interleave in what a reader gets.
- The read reports to the span current when `run` starts (the HTTP server span, when traced): a
  `gen_ai.first_token` event, a `pagewise.restarted` event per new attempt, and at the end the billed tokens and
  the finish reasons. Nothing of the prompt or the output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator

from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span

from pagewise import tracing
from pagewise.platform.adapters.schemas import model_name
from pagewise.platform.adapters.service import resolve_adapter
from pagewise.platform.billing.prices import current_rate
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.inference.prompts import PreparedRequest
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.admission import cheap_refusal, never_fits
from pagewise.platform.quotas.headers import quota_exceeded, rate_limit_headers
from pagewise.platform.quotas.quota_store import Decision
from pagewise.platform.services import PlatformServices
from pagewise.serving.ledgers import FinishedRequest, finished_event
from pagewise.serving.protocol import (
    ChoiceDelta,
    ChoiceSoFar,
    Delta,
    ErrorCode,
    ErrorInfo,
    Event,
    Finished,
    Rejected,
    RequestStatus,
    Reservation,
    Submit,
    Usage,
    price_models,
)
from pagewise.serving.settlement import Settlement

logger = logging.getLogger(__name__)
_ID_PREFIX = {"chat.completions": "chatcmpl", "completions": "cmpl"}
STALL_S = 30.0  # with no event for this long, the reader looks at the row
ENDED_WAIT_S = 30.0  # how long `end` waits for the engine to write the final row
NOT_HANDED_OVER = "the request could not be handed to an engine"  # a row's error when no engine got it


def new_request_id(endpoint: str) -> str:
    """A request's id in OpenAI's shape for its endpoint: `chatcmpl-…` or `cmpl-…`."""
    return new_id(_ID_PREFIX[endpoint], separator="-")


def engine_error(error: ErrorInfo) -> APIError:
    """The HTTP error for an engine-side refusal or failure."""
    if error.code is ErrorCode.INVALID_REQUEST:
        return invalid_request(error.message, param=error.param)
    if error.code is ErrorCode.INTERNAL:  # the details stay in the log
        return APIError(500, "Internal server error", type="api_error")
    messages = {
        ErrorCode.ENGINE_UNAVAILABLE: "The inference engine is unavailable",
        ErrorCode.WORKER_LOST: "The engine worker running this request stopped, and the request cannot resume",
        ErrorCode.QUEUE_TIMEOUT: "The request waited too long for an engine",
    }
    return APIError(503, messages[error.code], code=error.code.value, headers={"Retry-After": "5"})


class InferenceJob:
    def __init__(
        self,
        services: PlatformServices,
        principal: Principal,
        prepared: PreparedRequest,
        request_id: str,
        reservation: Reservation,
        headers: dict[str, str],
        handed_over_at: float | None = None,
    ) -> None:
        self.services = services
        self.principal = principal
        self.prepared = prepared
        self.id = request_id
        self.reservation = reservation
        self.headers = headers
        self.created = int(time.time())
        self.choices = {i: ChoiceSoFar(i) for i in range(prepared.num_sequences)}
        self.final: Finished | None = None
        self._ended = False  # a terminal event was seen (or the row was found final)
        self._attempt = 1
        self._delivered: dict[int, int] = {}  # restarted: tokens per choice the reader already has
        self._replayed: dict[int, int] = {}  # restarted: tokens per choice the new attempt has produced
        self._prompt_tokens = 0
        self._cached_tokens = 0
        self._start = time.monotonic()
        self._handed_over_at = handed_over_at  # monotonic, just before the Submit went to the transport
        self._first_token: float | None = None
        self._span: Span = INVALID_SPAN  # the span `run` reports to (the HTTP request's, when traced)

    @staticmethod
    async def precheck(services: PlatformServices, principal: Principal) -> None:
        """Before the costly part of preparing a request (tokenizing it): a 503 when no engine can take it and a
        429 when the tenant is already at its concurrency or request-rate limit, or the key at its request-rate
        limit, so a flood of large prompts costs the server a counter read each. Admission checks everything
        again; this only refuses early."""
        services.engine.transport.check_capacity(principal.tenant_id)
        decision = await cheap_refusal(services.quotas, principal.tenant_id, principal.limits, principal.key_quota)
        if decision is not None:
            services.metrics.quota_rejections.labels(principal.tenant_id, decision.rejected_by).inc()
            raise quota_exceeded(decision, 0)

    @classmethod
    async def admit(
        cls,
        services: PlatformServices,
        principal: Principal,
        prepared: PreparedRequest,
        *,
        request_id: str | None = None,
        batch_id: str | None = None,
    ) -> InferenceJob:
        """Check capacity and the key's models, reserve quota (tenant and key, tokens and spend), persist the
        `queued` row, hand the request to an engine. A batch line passes the id it claimed and its batch's."""
        services.engine.transport.check_capacity(principal.tenant_id)
        if prepared.adapter is None and prepared.model != prepared.base_model:
            adapter = await resolve_adapter(services, principal.tenant_id, prepared.model)
            # recorded, billed and answered under one name, whichever alias of the base the request used
            canonical = model_name(services.engine.model_name, adapter.name)
            prepared = dataclasses.replace(prepared, model=canonical, adapter=adapter)
        if principal.allowed_models is not None and not {prepared.model, prepared.base_model} & set(
            principal.allowed_models
        ):
            raise APIError(
                403,
                f"This API key may not use model '{prepared.model}'; it may use: {', '.join(principal.allowed_models)}",
                code="model_not_allowed",
                param="model",
            )
        request_id = request_id or new_request_id(prepared.endpoint)
        decision, reservation = await _reserve(services, principal, prepared, request_id, interactive=batch_id is None)
        lease = services.lease_expiry()
        await _persist_queued(services, principal, prepared, request_id, reservation, lease, batch_id)
        submit = Submit(
            request_id=request_id,
            tenant_id=principal.tenant_id,
            model=prepared.base_model,
            adapter=prepared.adapter,
            endpoint=prepared.endpoint,
            prompts=prepared.prompts,
            params=prepared.params,
            reservation=reservation,
            tenant_weight=principal.weight,
            priority=prepared.priority,
            # an engine taking it later than its row's lease would run work nobody waits for: the orphan sweep
            # fails such a row, and the reservation's lease has run out with it
            deadline=lease.timestamp(),
        )
        handed_over_at = time.monotonic()
        try:
            await services.engine.transport.submit(submit)
        except (APIError, asyncio.CancelledError) as exc:  # already an answer, or the caller went away
            await cls._unsubmitted(services, submit, exc)
            raise
        except Exception as exc:  # the transport failed (Redis down): a 503 to retry, not an opaque 500
            await cls._unsubmitted(services, submit, exc)
            raise engine_error(ErrorInfo(ErrorCode.ENGINE_UNAVAILABLE, "not handed to an engine")) from None
        headers = rate_limit_headers(decision)
        return cls(services, principal, prepared, request_id, reservation, headers, handed_over_at)

    @staticmethod
    async def _unsubmitted(services: PlatformServices, submit: Submit, exc: BaseException) -> None:
        """No engine got the request: fail its row (with a public message; the cause goes to the log) and give its
        reservation back."""
        logger.warning("request %s was not handed to an engine", submit.request_id, exc_info=exc)
        failed = FinishedRequest.failed(ErrorInfo(ErrorCode.ENGINE_UNAVAILABLE, NOT_HANDED_OVER))
        await Settlement(services.requests, services.quotas).settle(submit, failed, attempt=1)

    @property
    def usage(self) -> Usage:
        """Tokens billed: the engine's final count once ended, before that what its deltas reported."""
        if self.final is not None:
            return self.final.usage
        return Usage(
            prompt_tokens=self._prompt_tokens,
            completion_tokens=sum(c.num_tokens for c in self.choices.values()),
            cached_tokens=self._cached_tokens,
        )

    @property
    def ended(self) -> bool:
        return self._ended

    async def run(self) -> AsyncIterator[ChoiceDelta]:
        """The request's choice deltas. Ends when the request does; a `failed` or refused request raises its
        `APIError`. Leaving early aborts the request. A job already ended yields nothing."""
        if self._ended:
            return
        self._span = trace.get_current_span()
        self._span.set_attributes({"gen_ai.request.model": self.prepared.model, "gen_ai.response.id": self.id})
        try:
            async for event in self._events():
                if not isinstance(event, Rejected) and event.attempt < self._attempt:
                    continue  # a superseded attempt's
                if isinstance(event, Delta):
                    for delta in self._news(event):
                        yield delta
                    continue
                self._ended = True
                if isinstance(event, Rejected):
                    raise engine_error(event.error)
                self.final = event
                self._observe(event)
                if event.error is not None:
                    raise engine_error(event.error)
        finally:
            if self.final is not None:
                reasons = [c.finish_reason for c in self.choices.values() if c.finish_reason]
                self._span.set_attributes(tracing.usage_attributes(self.final.usage, reasons))
            if not self._ended:
                await asyncio.shield(self.services.engine.transport.abort(self.id))

    async def collect(self) -> list[ChoiceSoFar]:
        """Run to the end; the choices in index order."""
        async for _ in self.run():
            pass
        return [self.choices[i] for i in sorted(self.choices)]

    async def end(self) -> None:
        """Make sure the request stops: unless its end was already seen, abort it and wait (bounded) until the
        engine has written its final row. Idempotent."""
        if not self._ended:
            await self.services.engine.transport.abort(self.id)
            await wait_ended(self.services, self.id, ENDED_WAIT_S)

    def _news(self, delta: Delta) -> list[ChoiceDelta]:
        """Record a delta; return what the reader has not had yet."""
        if delta.attempt > self._attempt:
            self._restart(delta.attempt)
        self._prompt_tokens, self._cached_tokens = delta.prompt_tokens, delta.cached_tokens
        news = []
        for choice in delta.choices:
            if self._delivered:
                replayed = self._replayed[choice.index] = self._replayed.get(choice.index, 0) + len(choice.token_ids)
                if replayed <= self._delivered.get(choice.index, 0):
                    continue  # the client has these tokens from the attempt that died
            self.choices[choice.index].add(choice)
            news.append(choice)
        if self._first_token is None and any(c.token_ids for c in news):
            self._first_token = time.monotonic()
            self._span.add_event("gen_ai.first_token")
            if self._handed_over_at is not None and delta.attempt == 1 and delta.engine_ttft_s is not None:
                waited = self._first_token - self._handed_over_at
                self.services.metrics.queue_hop.observe(max(0.0, waited - delta.engine_ttft_s))
        return news

    def _restart(self, attempt: int) -> None:
        self._attempt = attempt
        self._span.add_event("pagewise.restarted", {"pagewise.attempt": attempt})
        delivered = {i: c.num_tokens for i, c in self.choices.items() if c.num_tokens}
        params = self.prepared.params
        if delivered and not (params.greedy or params.seed is not None):
            message = "the engine worker running this request stopped; a sampled stream cannot resume"
            raise engine_error(ErrorInfo(ErrorCode.WORKER_LOST, message))
        self._delivered, self._replayed = delivered, {}

    async def _events(self) -> AsyncIterator[Event]:
        """The request's events; after `STALL_S` without one, a final row ends the read (its engine died after
        writing it, or a sweep failed the request); an unfinished row means keep waiting."""
        transport, seen = self.services.engine.transport, 0
        while True:
            stream = transport.events(self.id)
            try:
                position = 0  # events read from this stream; the first `seen` were yielded by an earlier one
                while True:
                    try:
                        event = await asyncio.wait_for(anext(stream), STALL_S)
                    except StopAsyncIteration:
                        break
                    position += 1
                    if position <= seen:
                        continue
                    seen += 1
                    yield event
                    if isinstance(event, Finished | Rejected):
                        return
            except TimeoutError:
                pass
            finally:
                await stream.aclose()
            final = await self.services.requests.final_state(self.id)
            if final is not None:
                yield finished_event(final, self._attempt)
                return

    def _observe(self, finished: Finished) -> None:
        """Latencies as this reader saw them (the engine's side counts requests and tokens)."""
        m, endpoint = self.services.metrics, self.prepared.endpoint
        now = time.monotonic()
        m.e2e_latency.labels(endpoint).observe(now - self._start)
        if self._first_token is not None:
            m.ttft.labels(endpoint).observe(self._first_token - self._start)
            generated = finished.usage.completion_tokens - len(self.choices)
            if generated > 0:
                m.tpot.labels(endpoint).observe((now - self._first_token) / generated)


def _has_spend_budget(principal: Principal) -> bool:
    """Whether a monthly spend budget (the tenant's or the key's) applies to the caller's requests."""
    key = principal.key_quota
    return principal.limits.monthly_spend_budget_micros is not None or (
        key is not None and key.limits.monthly_spend_budget_micros is not None
    )


async def wait_ended(services: PlatformServices, request_id: str, timeout: float) -> None:
    """Wait (bounded) until the request's terminal event, from any replica; returns at once if its row is final."""
    if await services.requests.final_state(request_id) is not None:
        return
    try:
        async with asyncio.timeout(timeout):
            async for event in services.engine.transport.events(request_id):
                if isinstance(event, Finished | Rejected):
                    return
    except TimeoutError:
        pass


async def _reserve(
    services: PlatformServices, principal: Principal, prepared: PreparedRequest, request_id: str, *, interactive: bool
) -> tuple[Decision, Reservation]:
    """Reserve the request's tokens, sequences and spend under the tenant's limits and the key's; a 400 when it
    could never fit them, a 429 when it does not fit now. A batch line (not `interactive`) is counted in the
    month's budgets only (`QuotaStore.reserve`)."""
    tokens, slots, key = prepared.reserved_tokens, prepared.num_sequences, principal.key_quota
    rate = None  # reserved spend only matters to a spend budget; the bill itself is priced at settlement
    if _has_spend_budget(principal):
        models = price_models(prepared.base_model, prepared.adapter)
        rate = await current_rate(services.database, models, sum(len(p) for p in prepared.prompts))
    spend = 0 if rate is None else rate.cost(tokens)
    refusal = never_fits(principal.limits, tokens, slots, spend) or (
        key and never_fits(key.limits, tokens, slots, spend, "key")
    )
    if refusal is not None:
        raise refusal
    decision = await services.quotas.reserve(
        principal.tenant_id, principal.limits, tokens, request_id, slots=slots, key=key, rate=rate,
        interactive=interactive,
    )
    if decision.reservation is None:
        services.metrics.quota_rejections.labels(principal.tenant_id, decision.rejected_by).inc()
        raise quota_exceeded(decision, tokens, slots, requested_spend=spend)
    return decision, decision.reservation


async def _persist_queued(
    services: PlatformServices,
    principal: Principal,
    prepared: PreparedRequest,
    request_id: str,
    reservation: Reservation,
    lease: dt.datetime,
    batch_id: str | None,
) -> None:
    """Write the request's `queued` row; if that fails, the reservation is given back before the error goes on."""
    record = RequestRecord(
        id=request_id,
        tenant_id=principal.tenant_id,
        api_key_id=principal.key_id,
        endpoint=prepared.endpoint,
        model=prepared.model,
        input=prepared.input,
        params=prepared.params_record(),
        status=RequestStatus.QUEUED,
        lease_expires_at=lease,
        trace_id=tracing.trace_id(),
        reserved_tokens=reservation.tokens,
        reserved_micros=reservation.spend,
        batch_id=batch_id,
    )
    try:
        await services.requests.create(record)
    except BaseException:
        await services.quotas.reconcile(reservation, 0)
        raise
