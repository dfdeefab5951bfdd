"""How a request ends, whichever path ends it: its final row written, its quota reservation reconciled, its
terminal event told — in that order, once. Every path that ends a request settles through `Settlement.settle`: an
execution that ran or refused its Submit, the Redis worker parking a Submit no worker could finish, the API
failing a request no engine took.

Invariants:
- The final write is guarded (`RequestLedger.finish` only moves an unfinished row). The settlement whose write
  finished the row reconciles the reservation to what that write billed (tokens and cost), and only then tells the
  terminal event — in one step with the reconcile where the transport offers one (`reconcile_and_emit`) — so a
  client that saw the end reads a final row and finds its quota slot free.
- A settlement whose write lost (the row was finished elsewhere: a sweep, another attempt) changes no row; it
  reconciles the reservation to what the row billed — a no-op unless the row's writer died before its own
  reconcile (`reconcile` acts once per reservation) — and tells the row's word, not its own.
- While the ledger's store is out of reach (a database restart) the write is retried with backoff for up to
  `FINAL_WRITE_PATIENCE_S`: the tokens were computed, and the row is where they are billed.
- With a `hold` that says no (another worker took the Submit over), nothing is written, reconciled or told:
  `Superseded` is raised, and the attempt that took over owns the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from pagewise import tracing
from pagewise.serving.ledgers import Billed, FinishedRequest, QuotaLedger, RequestLedger, finished_event
from pagewise.serving.protocol import Event, Rejected, Reservation, Submit

logger = logging.getLogger(__name__)
FINAL_WRITE_PATIENCE_S = 60.0  # how long the final write is retried while the ledger's store is out of reach
FINAL_WRITE_MAX_DELAY_S = 5.0

Emit = Callable[[Event], Awaitable[None]]
# A transport's reconcile-then-emit in one step (tokens, cost micro-dollars), so no reader sees the terminal event
# before the reconcile.
ReconcileAndEmit = Callable[[Reservation, int, "int | None", Event], Awaitable[None]]
# Whether the caller still holds its Submit: False once another worker has taken it over.
Hold = Callable[[], Awaitable[bool]]


class Superseded(Exception):
    """The Submit was taken over by another worker's attempt: this one stopped and said nothing."""


@dataclass(frozen=True, slots=True)
class Settled:
    """What a settlement did: the event it told, and whether its own write finished the row."""

    event: Event
    won: bool


@dataclass(frozen=True, slots=True)
class Settlement:
    """The ledgers and the transport's hooks a request settles through. `emit` None: nobody reads the request's
    events (the API failing a request it never handed over); `reconcile_and_emit` None: `quotas.reconcile`, then
    `emit`; `hold` None: the Submit is the caller's for good."""

    requests: RequestLedger
    quotas: QuotaLedger
    emit: Emit | None = None
    reconcile_and_emit: ReconcileAndEmit | None = None
    hold: Hold | None = None

    async def check_held(self, submit: Submit) -> None:
        """Raise `Superseded` when another worker has taken `submit` over."""
        if self.hold is not None and not await self.hold():
            raise Superseded(f"request {submit.request_id} was taken over by another attempt")

    async def settle(self, submit: Submit, result: FinishedRequest, *, attempt: int, refused: bool = False) -> Settled:
        """Write `result` as the request's end, reconcile, tell (see the module's invariants). `refused`: the
        request never ran (its terminal event is `Rejected`, with `result.error`)."""
        await self.check_held(submit)
        billed = await self._write(submit, result)
        own: Event = Rejected(error=result.error) if refused and result.error else finished_event(result, attempt)
        if billed is not None:
            tokens = result.prompt_tokens + result.completion_tokens
            await self._reconcile_and_emit(submit.reservation, tokens, billed.cost_micros, own)
            return Settled(own, won=True)
        final = await self.requests.final_state(submit.request_id)
        if final is None:  # no final row to defer to (gone, or never written): our own word, nothing billed
            return Settled(await self._told(own), won=False)
        return Settled(await self.replay(submit, final, attempt=attempt), won=False)

    async def replay(self, submit: Submit, final: FinishedRequest, *, attempt: int) -> Event:
        """Tell the end a final row already records (a redelivered Submit, a lost write): its reservation is
        reconciled to what the row billed first — a no-op unless the row's writer died before its reconcile."""
        await self.quotas.reconcile(submit.reservation, final.prompt_tokens + final.completion_tokens)
        return await self._told(finished_event(final, attempt))

    async def _write(self, submit: Submit, result: FinishedRequest) -> Billed | None:
        request_id = submit.request_id
        attributes = {"pagewise.status": str(result.status)}
        with tracing.tracer().start_as_current_span("pagewise.persist", attributes=attributes) as span:
            deadline, delay = time.monotonic() + FINAL_WRITE_PATIENCE_S, 0.1
            while True:
                try:
                    billed = await self.requests.finish(
                        request_id, submit.tenant_id, submit.usage_model, result, price_models=submit.price_models
                    )
                    break
                except Exception as error:
                    if not self.requests.is_unreachable(error) or time.monotonic() + delay > deadline:
                        raise
                    logger.warning("request %s: final write failed (%s); retrying in %.1f s", request_id, error, delay)
                    await asyncio.sleep(delay)
                    delay = min(2 * delay, FINAL_WRITE_MAX_DELAY_S)
            span.set_attribute("pagewise.persist.won", billed is not None)
            return billed

    async def _reconcile_and_emit(self, reservation: Reservation, tokens: int, cost: int | None, event: Event) -> None:
        if self.emit is not None and self.reconcile_and_emit is not None:
            await self.reconcile_and_emit(reservation, tokens, cost, event)
            return
        await self.quotas.reconcile(reservation, tokens, cost)
        await self._told(event)

    async def _told(self, event: Event) -> Event:
        if self.emit is not None:
            await self.emit(event)
        return event
