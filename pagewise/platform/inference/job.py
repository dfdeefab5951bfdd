"""One admitted inference request, from quota reservation to its final row.

Invariants:
- Admission reserves quota first and writes the `queued` row second; if the write fails the reservation is
  released, so there is never a row without a reservation or a reservation without a row.
- Settlement happens exactly once, whatever ends the job: completion, engine error, the engine rejecting the
  request, an engine-side abort, a client that hangs up (even before the first chunk, when `run` never
  started), DELETE (even before the background task ran), shutdown. The first call to `finish` wins: it
  writes the final row (a terminal status: completed / failed / cancelled) with the day's usage and
  reconciles the quota to the billed tokens; every later call only waits for that write.
- Whoever hands a job to something that may never run it (a streaming response, a background task) also
  arranges for `finish("cancelled")` if that never happens: `SettlingStream` and `start_in_background`.
- Billed tokens are what the engine really computed, always: the prompt tokens it processed (a prefill cut short
  by a disconnect bills the chunks that ran) plus every token it generated — also those generated between a
  client's disconnect and the engine seeing the abort. The engine reports that count once per prompt, when the
  request leaves it for any reason (`usage` futures); the final write waits for those reports.
- While a job is live (`services.live`), the lease heartbeat (`leases.py`) keeps its quota lease and its row's
  lease fresh; a process that dies stops renewing, so its slots come back and its rows are failed as orphans.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from pagewise.engine.errors import EngineDeadError, InvalidRequestError
from pagewise.platform.db.ids import new_id
from pagewise.platform.db.models import RequestRecord
from pagewise.platform.engine_client import ChoiceDelta, GenerationDelta, PositionLogprobs
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.inference.prompts import PreparedRequest
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.admission import never_fits
from pagewise.platform.quotas.headers import quota_exceeded, rate_limit_headers
from pagewise.platform.quotas.quota_store import Decision, Reservation, first_rejection
from pagewise.platform.requests.store import FinishedRequest
from pagewise.platform.services import PlatformServices

logger = logging.getLogger(__name__)
_ID_PREFIX = {"chat.completions": "chatcmpl", "completions": "cmpl"}
ABORTED = "abort"  # the engine's finish_reason for a request aborted on its side
USAGE_REPORT_TIMEOUT_S = 30.0  # how long the final write waits for the engine's usage reports


@dataclass(slots=True)
class ChoiceState:
    """Everything one sample produced so far."""

    index: int
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    finish_reason: str | None = None
    logprobs: list[PositionLogprobs] = field(default_factory=list)

    @property
    def full_text(self) -> str:
        return "".join(self.text)


@dataclass(slots=True, frozen=True)
class Billed:
    """Tokens the engine computed for a job: what its row, its usage and its quota reconciliation record."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    @property
    def total(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass(slots=True)
class _PromptState:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    reached_engine: bool = False
    report: concurrent.futures.Future | None = None  # the engine's final usage for this prompt


class InferenceJob:
    def __init__(
        self,
        services: PlatformServices,
        principal: Principal,
        prepared: PreparedRequest,
        request_id: str,
        reservation: Reservation,
        headers: dict[str, str],
    ) -> None:
        self.services = services
        self.principal = principal
        self.prepared = prepared
        self.id = request_id
        self.reservation = reservation
        self.headers = headers
        self.created = int(time.time())
        self.choices = {i: ChoiceState(i) for i in range(len(prepared.prompts) * prepared.params.n)}
        self._prompts = [_PromptState() for _ in prepared.prompts]
        self._start = time.monotonic()
        self._started_at = dt.datetime.now(dt.UTC)
        self._first_token: float | None = None
        self._first_token_at: dt.datetime | None = None
        self._persisting: asyncio.Task[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._billed: Billed | None = None

    @staticmethod
    async def precheck(services: PlatformServices, principal: Principal) -> None:
        """Before the costly part of preparing a request (tokenizing it): a 429 when the tenant is already at its
        concurrency or request-rate limit (no slot free, no request left this minute), so a flood of large
        prompts costs the server a counter read each. Admission checks everything again, atomically, and tells
        a request that could never fit (a 400) from one that must wait; this only refuses early."""
        limits = principal.limits
        if limits.max_concurrent_requests is None and limits.requests_per_minute is None:
            return
        usage = await services.quotas.usage(principal.tenant_id)
        rejected = first_rejection(limits, 0, 1, usage.concurrent, usage.requests_this_minute, 0, 0)
        if rejected is not None:
            services.metrics.quota_rejections.labels(principal.tenant_id, rejected).inc()
            raise quota_exceeded(Decision(None, rejected, usage, limits), 0)

    @classmethod
    async def admit(
        cls, services: PlatformServices, principal: Principal, prepared: PreparedRequest
    ) -> InferenceJob:
        """Reserve quota (400 if it can never fit, 429 when refused now), then persist the `queued` row."""
        request_id = new_id(_ID_PREFIX[prepared.endpoint])
        tokens, slots = prepared.reserved_tokens, prepared.num_sequences
        refusal = never_fits(principal.limits, tokens, slots)
        if refusal is not None:
            raise refusal
        decision = await services.quotas.reserve(
            principal.tenant_id, principal.limits, tokens, request_id, slots=slots
        )
        if decision.reservation is None:
            services.metrics.quota_rejections.labels(principal.tenant_id, decision.rejected_by).inc()
            raise quota_exceeded(decision, tokens, slots)
        record = RequestRecord(
            id=request_id,
            tenant_id=principal.tenant_id,
            api_key_id=principal.key_id,
            endpoint=prepared.endpoint,
            model=prepared.model,
            input=prepared.input,
            params=prepared.params_record(),
            status="queued",
            lease_expires_at=services.lease_expiry(),
        )
        try:
            await services.requests.create(record)
        except BaseException:
            await services.quotas.reconcile(decision.reservation, 0)
            raise
        job = cls(services, principal, prepared, request_id, decision.reservation, rate_limit_headers(decision))
        services.live[request_id] = job
        return job

    @property
    def usage(self) -> Billed:
        """Tokens billed: the engine's final count once settled, before that what its deltas reported."""
        if self._billed is not None:
            return self._billed
        return Billed(
            prompt_tokens=sum(p.prompt_tokens for p in self._prompts if p.reached_engine),
            completion_tokens=sum(c.num_tokens for c in self.choices.values()),
            cached_tokens=sum(p.cached_tokens for p in self._prompts if p.reached_engine),
        )

    @property
    def settled(self) -> bool:
        """True once the final write has begun: the job will not (or no longer) run on the engine."""
        return self._persisting is not None

    async def run(self) -> AsyncIterator[ChoiceDelta]:
        """Deltas with request-wide choice indexes. Leaving early cancels the request (and bills it).

        Ends `completed`, `cancelled` (left early, or aborted on the engine's side) or `failed` (the error
        propagates; an engine rejection as a 400 `APIError`). A job already settled yields nothing.
        """
        if self.settled:
            return
        status, error = "cancelled", None
        n = self.prepared.params.n
        try:
            async with aclosing(self._engine_deltas()) as deltas:
                async for prompt_index, delta in deltas:
                    self._record(prompt_index, delta)
                    for choice in delta.choices:
                        yield ChoiceDelta(
                            prompt_index * n + choice.index,
                            choice.text,
                            choice.token_ids,
                            choice.finish_reason,
                            choice.logprobs,
                        )
            aborted = any(c.finish_reason == ABORTED for c in self.choices.values())
            status = "cancelled" if aborted else "completed"
        except InvalidRequestError as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise invalid_request(str(exc)) from None
        except EngineDeadError as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise APIError(503, "The inference engine is unavailable", code="engine_unavailable") from exc
        except Exception as exc:
            status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            await self.finish(status, error)

    async def collect(self) -> list[ChoiceState]:
        """Run to the end; the choices in index order."""
        async with aclosing(self.run()) as deltas:
            async for _ in deltas:
                pass
        return [self.choices[i] for i in sorted(self.choices)]

    def start_in_background(self) -> None:
        """Run to the end in a task of its own (async requests), listed in `services.running` meanwhile.

        If the task is cancelled before its first step its body never runs; the done-callback then settles
        the job as `cancelled`, so `cancel` and shutdown never leave a held slot or a `queued` row.
        """

        async def run() -> None:
            try:
                await self.collect()
            except Exception:
                logger.exception("async request %s failed", self.id)

        running = self.services.running
        self._task = self.services.spawn(run())
        running[self.id] = self

        def done(_: asyncio.Task[None]) -> None:
            running.pop(self.id, None)
            self._begin_finish("cancelled", None)  # a no-op unless the body never ran

        self._task.add_done_callback(done)

    async def cancel(self) -> None:
        """Cancel the job wherever it is (never started, running in the background, or done: a no-op)
        and wait until its final row is written."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.finish("cancelled", None)

    def _engine_deltas(self) -> AsyncIterator[tuple[int, GenerationDelta]]:
        return _merge([self._submit(i) for i in range(len(self.prepared.prompts))])

    async def _submit(self, prompt_index: int) -> AsyncIterator[GenerationDelta]:
        """One prompt's deltas. Its usage report exists only once the engine was actually asked (a stream closed
        before its first step never reaches the engine, and bills nothing)."""
        engine, tenant = self.services.engine, self.principal.tenant_id  # the salt comes from the key only
        state = self._prompts[prompt_index]
        state.report = concurrent.futures.Future()
        prompt = self.prepared.prompts[prompt_index]
        request_id = f"{self.id}-{prompt_index}"
        stream = engine.generate(
            prompt, self.prepared.params, request_id, tenant, state.report, tenant_weight=self.principal.weight
        )
        async with aclosing(stream) as deltas:
            async for delta in deltas:
                yield delta

    def _record(self, prompt_index: int, delta: GenerationDelta) -> None:
        prompt = self._prompts[prompt_index]
        prompt.reached_engine = True
        prompt.prompt_tokens, prompt.cached_tokens = delta.prompt_tokens, delta.cached_tokens
        base = prompt_index * self.prepared.params.n
        for choice in delta.choices:
            state = self.choices[base + choice.index]
            state.text.append(choice.text)
            state.num_tokens += len(choice.token_ids)
            state.finish_reason = choice.finish_reason or state.finish_reason
            state.logprobs.extend(choice.logprobs or ())
        if self._first_token is None and any(c.token_ids for c in delta.choices):
            self._first_token = time.monotonic()
            self._first_token_at = dt.datetime.now(dt.UTC)
            if not delta.finished:
                self.services.spawn(
                    self.services.requests.mark_running(self.id, self._started_at, self._first_token_at)
                )

    async def finish(self, status: str, error: str | None) -> None:
        """Exactly once: the final row, the day's usage, the quota reconciliation and the metrics.

        The first call decides the status; the write runs in a task of its own, so cancelling the caller
        (a client gone, a DELETE, shutdown) never interrupts it half-way.
        """
        await asyncio.shield(self._begin_finish(status, error))

    def _begin_finish(self, status: str, error: str | None) -> asyncio.Task[None]:
        if self._persisting is None:
            self._persisting = self.services.spawn(self._persist(status, error))
        return self._persisting

    async def wait_finished(self) -> None:
        """Wait until the final row is written (after `finish`, which may itself have been interrupted)."""
        if self._persisting is not None:
            await asyncio.shield(self._persisting)

    async def _engine_report(self) -> Billed:
        """The engine's own count of what it computed, summed over the prompts that reached it."""
        reports = [p.report for p in self._prompts if p.report is not None]
        if not reports:
            return Billed()
        try:
            usages = await asyncio.wait_for(
                asyncio.gather(*(asyncio.wrap_future(r) for r in reports)), USAGE_REPORT_TIMEOUT_S
            )
        except Exception:  # noqa: BLE001 - a dead or hung engine: bill what its deltas reported
            logger.exception("request %s: no usage report from the engine; billing the streamed counts", self.id)
            return self.usage
        return Billed(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=sum(u.cached_tokens for u in usages),
        )

    async def _persist(self, status: str, error: str | None) -> None:
        billed = self._billed = await self._engine_report()
        ordered = [self.choices[i] for i in sorted(self.choices)]
        result = FinishedRequest(
            status=status,
            output=[
                {"index": c.index, "text": c.full_text, "finish_reason": c.finish_reason} for c in ordered
            ],
            finish_reason=ordered[0].finish_reason,
            prompt_tokens=billed.prompt_tokens,
            completion_tokens=billed.completion_tokens,
            cached_tokens=billed.cached_tokens,
            error=error,
            started_at=self._started_at,
            first_token_at=self._first_token_at,
            finished_at=dt.datetime.now(dt.UTC),
        )
        try:
            await self.services.requests.finish(
                self.id, self.principal.tenant_id, self.prepared.model, result
            )
        finally:
            self.services.live.pop(self.id, None)
            await self.services.quotas.reconcile(self.reservation, billed.total)
            self._observe(status, billed)

    def _observe(self, status: str, billed: Billed) -> None:
        m, tenant, endpoint = self.services.metrics, self.principal.tenant_id, self.prepared.endpoint
        now = time.monotonic()
        m.requests.labels(tenant, endpoint, status).inc()
        m.tokens.labels(tenant, "prompt").inc(billed.prompt_tokens)
        m.tokens.labels(tenant, "completion").inc(billed.completion_tokens)
        m.tokens.labels(tenant, "cached").inc(billed.cached_tokens)
        m.e2e_latency.labels(endpoint).observe(now - self._start)
        if self._first_token is not None:
            m.ttft.labels(endpoint).observe(self._first_token - self._start)
            if billed.completion_tokens > len(self.choices):
                m.tpot.labels(endpoint).observe(
                    (now - self._first_token) / (billed.completion_tokens - len(self.choices))
                )


async def _merge(streams: list[AsyncIterator[GenerationDelta]]) -> AsyncIterator[tuple[int, GenerationDelta]]:
    """Interleave several prompts' streams as their deltas arrive; leaving early closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for delta in stream:
                yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, GenerationDelta | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[GenerationDelta]) -> None:
        try:
            async for delta in stream:
                queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
