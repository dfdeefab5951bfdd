"""`pagewise worker`: one engine serving Submits from Redis Streams, crash-safe and cancellable.

Invariants:
- A Submit is acknowledged (`XACK`, then deleted) only after its execution emitted the terminal event, which
  comes after the final row was written. A worker that dies leaves its in-flight Submits pending.
- Every worker heartbeats (`WorkerHeartbeat` in the model's worker hash, plus an `alive` key that expires after
  `heartbeat_ttl_s`). A live worker adopts the streams of a dead one: it claims the pending Submits
  (`XAUTOCLAIM`, idle at least one TTL) and reads the ones never delivered, and runs each again from the start
  as a new attempt. A Submit delivered more than `max_deliveries` times goes to the dead-letter stream and its
  request fails with the reason; no Submit is lost or run by two live workers at once.
- A redelivered Submit never bills twice: the final write is guarded, and a request already final is answered
  from its row (`Execution.run`).
- A live worker's Submits are never taken over, and a presumed-dead one's attempt is fenced: every beat, the
  worker re-claims the pending entries it holds (`HOLD_SCRIPT`: each one still its own is claimed again, which
  resets its idle time, atomically), so an adopter's claim — which needs an entry idle for a whole TTL — can
  only win once the holder has stopped beating for that long. A holder that wakes from such a stall asks again
  before its next delta or final write (`Execution`'s `hold`); an entry another worker claimed meanwhile is
  not its own any more, and that attempt stops without a word (`Superseded`) and is not acknowledged.
- An abort is never lost: it reaches the worker through pub/sub at once, or through the `aborted` key — read
  when the Submit is taken, and for every request in flight each time the subscription is (re)made, since
  one published while it was down reached nobody. One published while a Submit is being taken (between its
  key check and its execution's creation) is remembered by the host and applied when the execution starts.
- A settlement — the winning execution's reconcile and its terminal event — is one MULTI/EXEC when the quotas
  live in this Redis: the reconcile runs first, and no reader sees the event without it.
- A Redis fault never ends the worker, nor fails a request it runs: reading the inbox, the abort channel,
  emitting a request's events and settling it (for up to `EMIT_PATIENCE_S`), acknowledging a finished Submit,
  the heartbeat and adoption each retry with backoff (`RETRY_MIN_S` doubling to `RETRY_MAX_S`). After a failed
  read the worker announces itself again — consumer group (a restarted Redis may have lost the stream), engine
  info, heartbeat — so a Redis that came back empty is served again without a restart of the worker.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import suppress
from typing import TypeVar

import redis.asyncio as redis
from redis.asyncio.client import Pipeline, PubSub

from pagewise import tracing
from pagewise.serving.faults import is_redis_fault
from pagewise.serving.host import EngineHost
from pagewise.serving.ledgers import FinishedRequest, PipelinedQuotaLedger
from pagewise.serving.protocol import (
    ErrorCode,
    ErrorInfo,
    Event,
    RedisKeys,
    Reservation,
    decode_submit,
    encode,
)
from pagewise.serving.settlement import Emit, ReconcileAndEmit, Superseded

logger = logging.getLogger(__name__)
READ_COUNT = 64
READ_BLOCK_MS = 1000
EVENTS_MAXLEN = 100_000  # entries kept per request stream (a runaway reader cannot grow Redis without bound)
EVENTS_TTL_S = 3600  # a request's events outlive its end by this long, for late readers and reconnects
RETRY_MIN_S, RETRY_MAX_S = 0.1, 5.0  # backoff after a Redis fault
EMIT_PATIENCE_S = 30.0  # how long a request's event or settlement is retried through Redis faults
STOP_GRACE_S = 60.0  # on stop, in-flight requests run this long to their end; the rest are left for adoption
GIVE_UP_TRIES = 30  # a request left for adoption is cancelled again each second for this long, until it ends
T = TypeVar("T")
HOLD_MARGIN = 0.5  # an execution asks Redis whether it still holds its Submit when the last hold is this old (in TTLs)
# KEYS: the streams of the held entries, ARGV: group, consumer, then one entry id per stream. Claims again each
# entry the consumer still has pending (idle time back to 0, delivery count unchanged); returns 1 per entry
# still held, 0 per entry another consumer has (or nobody, once acknowledged). An entry whose stream or group is
# gone (Redis lost its data) counts as held: nobody else can claim it either.
HOLD_SCRIPT = """
local held = {}
for i, stream in ipairs(KEYS) do
  local id = ARGV[i + 2]
  local ok, pending = pcall(redis.call, 'XPENDING', stream, ARGV[1], id, id, 1)
  if not ok then
    held[i] = 1
  elseif pending[1] and pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', stream, ARGV[1], ARGV[2], 0, id, 'JUSTID')
    held[i] = 1
  else
    held[i] = 0
  end
end
return held
"""


def _log_failure(what: str, error: Exception) -> None:
    """A Redis fault in one line (it is expected while Redis restarts); anything else with its traceback."""
    if is_redis_fault(error):
        logger.warning("%s failed (%s); retrying at the next beat", what, error)
    else:
        logger.error("%s failed", what, exc_info=error)


class RedisWorker:
    def __init__(
        self,
        host: EngineHost,
        client: redis.Redis,
        keys: RedisKeys,
        *,
        worker_id: str | None = None,
        heartbeat_s: float = 1.0,
        max_deliveries: int = 3,
    ) -> None:
        self.host = host
        self.model = host.engine.model_name
        self.worker_id = worker_id or f"{host.hostname}-{uuid.uuid4().hex[:8]}"
        self._redis = client
        self._keys = keys
        self._heartbeat_s = heartbeat_s
        self._ttl_s = 5 * heartbeat_s
        self._max_deliveries = max_deliveries
        self._stopping = asyncio.Event()
        self._ended = asyncio.Event()  # set once in-flight work is done: the heartbeat and adopter loops end
        self._inflight: set[asyncio.Task[None]] = set()
        self._taking: set[str] = set()  # request ids between their aborted-key check and their execution
        self._held: dict[str, tuple[str, bytes]] = {}  # request id → (stream, entry id) of a Submit taken here
        self._held_at = time.monotonic()  # when the last hold that succeeded was sent
        self._holding: asyncio.Future[set[str]] | None = None  # the hold in flight, shared by all who ask
        self._hold_script = client.register_script(HOLD_SCRIPT)
        store = getattr(host.quotas, "store", host.quotas)  # under a tracing wrapper, the store itself
        # quotas in this Redis: a settlement's reconcile and its events go in one transaction (one round trip)
        self._redis_quotas = store if isinstance(store, PipelinedQuotaLedger) else None

    @property
    def inbox(self) -> str:
        return self._keys.submissions(self.worker_id)

    async def run(self) -> None:
        """Serve until `stop()`: announce, heartbeat, listen for aborts, adopt dead workers, consume the inbox.
        On stop, in-flight requests run to their end first (bounded: `_finish_inflight`)."""
        await self._announce()
        self.host.start()
        tasks = [
            asyncio.create_task(self._keep_beating()),
            asyncio.create_task(self._listen_for_aborts()),
            asyncio.create_task(self._keep_adopting()),
        ]
        logger.info("worker %s serving %s (inbox %s)", self.worker_id, self.model, self.inbox)
        try:
            await self._serve_inbox()
        finally:
            await self._finish_inflight()
            # the loops also end by this flag: a cancellation swallowed inside a Redis call (seen on Python 3.11)
            # once left the adopter looping and this stop waiting forever
            self._ended.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            with suppress(redis.RedisError):  # Redis down: the key expires by itself
                await self._redis.delete(self._keys.alive(self.worker_id))  # others adopt what is left in the inbox

    async def _finish_inflight(self) -> None:
        """In-flight requests run to their end for up to `STOP_GRACE_S`; one still running then is cancelled, and
        stays for another worker: its row unfinished, its Submit never acknowledged, so it is adopted (and run
        anew, billed once) when this worker's heartbeat is gone. The stop is bounded either way."""
        if self._inflight:
            _, left = await asyncio.wait(list(self._inflight), timeout=STOP_GRACE_S)
            if left:
                logger.warning("stopping with %d requests still running; they are left for adoption", len(left))
                # their holds say no from now on: an execution that outlives its cancellation (one swallowed
                # inside a Redis call, as Python 3.11's timeouts can) ends `Superseded` at its next delta
                self._held.clear()
                for _ in range(GIVE_UP_TRIES):
                    for task in left:
                        task.cancel()
                    _, left = await asyncio.wait(left, timeout=1.0)
                    if not left:
                        break
                else:
                    logger.error("%d requests did not stop when given up; the host's drain aborts them", len(left))
        await self.host.drain()

    def stop(self) -> None:
        self._stopping.set()

    async def _announce(self) -> None:
        """Make this worker known: its inbox's consumer group, the model's engine info, a heartbeat."""
        await self._ensure_group(self.inbox)
        info = self.host.engine_info(with_tokenizer=True)
        await self._redis.set(self._keys.info(self.model), encode(info))
        await self._beat()

    async def _serve_inbox(self) -> None:
        """Consume the inbox until `stop()`, riding out Redis faults (see the module's invariants)."""
        await self._riding_out_faults(lambda: self._consume(self.inbox), "reading the inbox", self._announce)

    async def _riding_out_faults(
        self,
        step: Callable[[], Awaitable[object]],
        what: str,
        recover: Callable[[], Awaitable[None]] | None = None,
        *,
        repeat: bool = True,
    ) -> None:
        """Run `step` again and again until `stop()` (`repeat=False`: until it succeeds once, tried at least once
        even after `stop()`); after a Redis fault wait (backoff from `RETRY_MIN_S` doubling to `RETRY_MAX_S`, reset
        by a step that succeeds), then try `recover` once (its own failure is the next step's fault). Any other
        error is raised."""
        delay = RETRY_MIN_S
        while not (repeat and self._stopping.is_set()):
            try:
                await step()
                if not repeat:
                    return
                delay = RETRY_MIN_S
            except Exception as error:
                if not is_redis_fault(error):
                    raise
                if self._stopping.is_set():
                    logger.warning("%s failed (%s) while stopping; left to the other workers", what, error)
                    return
                logger.warning("%s failed (%s); retrying in %.1f s", what, error, delay)
                await self._pause(delay)
                delay = min(2 * delay, RETRY_MAX_S)
                if recover is not None:
                    with suppress(Exception):
                        await recover()

    async def _pause(self, seconds: float) -> None:
        """Sleep for `seconds`, or less if the worker is stopped meanwhile."""
        with suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    # ---- consuming

    async def _ensure_group(self, stream: str) -> None:
        try:
            await self._redis.xgroup_create(stream, RedisKeys.GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _consume(self, stream: str, *, block_ms: int | None = READ_BLOCK_MS) -> int:
        """Read and start up to `READ_COUNT` Submits never delivered from `stream` (waiting up to `block_ms` for
        one; `None`: not at all); returns how many."""
        reply = await self._redis.xreadgroup(
            RedisKeys.GROUP, self.worker_id, {stream: ">"}, count=READ_COUNT, block=block_ms
        )
        started = 0
        for _, entries in reply or []:
            for entry_id, fields in entries:
                await self._start(stream, entry_id, fields, attempt=1)
                started += 1
        return started

    async def _start(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], *, attempt: int) -> None:
        try:
            submit = decode_submit(fields[b"m"])
        except Exception:  # noqa: BLE001 - an entry no version of pagewise wrote: drop it, loudly
            logger.exception("dropping malformed entry %s of %s", entry_id, stream)
            await self._ack(stream, entry_id)
            return
        request_id = submit.request_id
        self._taking.add(request_id)  # an abort arriving from now on is remembered by the host
        try:
            if await self._redis.exists(self._keys.aborted(request_id)):
                self.host.abort(request_id)  # remembered, and applied when `run` creates the execution
            emit, settle = self._emitter(request_id), self._settler(request_id)
            self._held[request_id] = (stream, entry_id)
            task = self.host.run(
                submit, emit, attempt=attempt, reconcile_and_emit=settle, hold=self._holder(request_id)
            )
        finally:
            self._taking.discard(request_id)

        async def finish() -> None:
            left = False  # the entry is another worker's (now or after this one stops): acknowledging drops it
            try:
                await task
            except Superseded:
                left = True
                if self._stopping.is_set():
                    logger.warning("request %s: this attempt stopped unfinished, left for adoption", request_id)
                else:
                    logger.warning("request %s was taken over by another worker; this attempt stopped", request_id)
            except asyncio.CancelledError:
                left = True  # a stop past its grace: the Submit stays pending for adoption
                raise
            finally:
                if not left:
                    # a fault at this moment must not lose the ack: retried until `stop()`; an entry left pending
                    # then is rerun by an adopter and answered from its final row (never billed twice)
                    await self._riding_out_faults(lambda: self._ack(stream, entry_id), "acknowledging", repeat=False)
                self._held.pop(request_id, None)

        wrapper = asyncio.create_task(finish())
        self._inflight.add(wrapper)
        wrapper.add_done_callback(self._inflight.discard)

    def _emitter(self, request_id: str) -> Emit:
        stream = self._keys.events(request_id)

        async def emit(event: Event) -> None:
            async def once() -> None:
                async with self._redis.pipeline(transaction=False) as pipe:
                    _queue_event(pipe, stream, event)
                    await pipe.execute()

            await _through_redis_faults(once, f"emitting an event of {request_id}")

        return emit

    def _settler(self, request_id: str) -> ReconcileAndEmit | None:
        """The reconcile and the terminal event in one MULTI/EXEC when the quotas live in this Redis: the reconcile
        runs first, and no reader can see the event before it (nor does the event go out if it cannot run)."""
        store = self._redis_quotas
        if store is None:
            return None
        stream = self._keys.events(request_id)

        async def settle(reservation: Reservation, tokens: int, cost: int | None, event: Event) -> None:
            async def once() -> bool:
                async with self._redis.pipeline(transaction=True) as pipe:
                    store.queue_reconcile(pipe, reservation, tokens, cost)
                    _queue_event(pipe, stream, event)
                    reconciled, *_ = await pipe.execute()
                return bool(reconciled)

            with tracing.reconcile_span(reservation, tokens) as span:
                reconciled = await _through_redis_faults(once, f"settling {request_id}")
                span.set_attribute("pagewise.quota.reconciled", reconciled)

        return settle

    async def _ack(self, stream: str, entry_id: bytes) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xack(stream, RedisKeys.GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    # ---- aborts

    async def _listen_for_aborts(self) -> None:
        """Apply aborts published for this model; a lost subscription is made again (with backoff), and then the
        aborts published while it was down are found by their keys."""
        await self._riding_out_faults(self._apply_aborts, "the abort subscription")

    async def _apply_aborts(self) -> None:
        pubsub = self._redis.pubsub()
        await pubsub.subscribe(self._keys.aborts(self.model))
        try:
            await _subscribed(pubsub)
            await self._abort_missed()
            while True:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                if message is not None and message["type"] == "message":
                    request_id = message["data"].decode()
                    if request_id in self.host.live or request_id in self._taking:
                        self.host.abort(request_id)
        finally:
            with suppress(Exception):
                await pubsub.aclose()

    async def _abort_missed(self) -> None:
        """Abort every request in flight (or being taken) whose `aborted` key is set: run once the subscription
        is confirmed, so an abort is either published to it or its key was set before this check."""
        request_ids = [*self.host.live, *self._taking]
        if not request_ids:
            return
        async with self._redis.pipeline(transaction=False) as pipe:
            for request_id in request_ids:
                pipe.exists(self._keys.aborted(request_id))
            flags = await pipe.execute()
        for request_id, aborted in zip(request_ids, flags, strict=True):
            if aborted:
                self.host.abort(request_id)

    # ---- holding the Submits taken here

    def _holder(self, request_id: str) -> Callable[[], Awaitable[bool]]:
        """The `hold` of one execution: False once a hold found its entry taken; True at once while the last hold
        is recent (no adopter can have claimed an entry idle for less than a TTL); else the answer of a new hold.
        A hold that fails (Redis down) answers True: the delta that follows fails the same way, and an entry
        cannot change hands while nobody reaches Redis."""

        async def hold() -> bool:
            if request_id not in self._held:
                return False
            if time.monotonic() - self._held_at < HOLD_MARGIN * self._ttl_s:
                return True
            try:
                return request_id in await self._hold()
            except redis.RedisError as error:
                _log_failure("holding the Submits", error)
                return True

        return hold

    async def _hold(self) -> set[str]:
        """Claim again every entry still held (one `HOLD_SCRIPT` call, shared by concurrent callers); the request
        ids still held. The executions of the others are stopped, and end `Superseded` without a word."""
        if self._holding is None:
            self._holding = asyncio.ensure_future(self._claim_held())
            self._holding.add_done_callback(lambda _: setattr(self, "_holding", None))
        return await asyncio.shield(self._holding)

    async def _claim_held(self) -> set[str]:
        held = dict(self._held)
        sent_at = time.monotonic()
        if not held:
            self._held_at = sent_at
            return set()
        streams, entry_ids = zip(*held.values(), strict=True)
        flags = await self._hold_script(keys=list(streams), args=[RedisKeys.GROUP, self.worker_id, *entry_ids])
        self._held_at = sent_at
        for request_id, flag in zip(held, flags, strict=True):
            if not flag and self._held.pop(request_id, None) is not None:
                # taken over: stopped now, and at its final write its hold says no, so it ends `Superseded`
                self.host.abort(request_id)
        return {request_id for request_id, flag in zip(held, flags, strict=True) if flag}

    # ---- heartbeat

    async def _beat(self) -> None:
        beat = self.host.heartbeat(self.worker_id, self.model)
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.hset(self._keys.workers(self.model), self.worker_id, encode(beat))
            pipe.set(self._keys.alive(self.worker_id), 1, px=int(self._ttl_s * 1000))
            await pipe.execute()

    async def _keep_beating(self) -> None:
        while not self._ended.is_set():
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self._beat()
                await self._hold()
            except Exception as error:  # noqa: BLE001 - the next beat retries
                _log_failure("the heartbeat", error)

    # ---- adopting a dead worker's Submits

    async def _keep_adopting(self) -> None:
        while not self._ended.is_set():
            await asyncio.sleep(self._heartbeat_s)
            try:
                await self.adopt_dead()
            except Exception as error:  # noqa: BLE001 - retried at the next beat
                _log_failure("adopting dead workers' requests", error)

    async def adopt_dead(self) -> None:
        """Take over the Submits of every worker of this model whose heartbeat expired."""
        for raw_id in await self._redis.hkeys(self._keys.workers(self.model)):
            worker_id = raw_id.decode()
            if worker_id == self.worker_id or await self._redis.exists(self._keys.alive(worker_id)):
                continue
            await self._adopt(worker_id)

    async def _adopt(self, dead_id: str) -> None:
        stream = self._keys.submissions(dead_id)
        claimed = await self._claim_pending(stream)
        started = await self._consume(stream, block_ms=None)
        if not claimed and not started:
            pending = await self._redis.xpending(stream, RedisKeys.GROUP)
            if not pending["pending"] and not await self._redis.xlen(stream):
                async with self._redis.pipeline(transaction=True) as pipe:
                    pipe.delete(stream)
                    pipe.hdel(self._keys.workers(self.model), dead_id)
                    await pipe.execute()
                logger.info("worker %s is gone; its inbox is empty and removed", dead_id)

    async def _claim_pending(self, stream: str) -> int:
        """Claim the Submits that dead consumers left pending in `stream` (idle for at least one heartbeat TTL);
        rerun each from the start, or dead-letter it once delivered too often. Entries a live worker holds —
        this one's included, when it adopted them earlier — are left alone."""
        min_idle_ms = int(self._ttl_s * 1000)
        pending = await self._redis.xpending_range(stream, RedisKeys.GROUP, "-", "+", READ_COUNT, idle=min_idle_ms)
        alive: dict[str, bool] = {self.worker_id: True}
        orphaned = []
        for entry in pending:
            consumer = entry["consumer"].decode()
            if consumer not in alive:
                alive[consumer] = bool(await self._redis.exists(self._keys.alive(consumer)))
            if not alive[consumer]:
                orphaned.append(entry)
        for entry in orphaned:
            entry_id = entry["message_id"]
            claimed = await self._redis.xclaim(stream, RedisKeys.GROUP, self.worker_id, min_idle_ms, [entry_id])
            if not claimed or claimed[0][1] is None:  # another worker was first, or the entry is gone
                continue
            deliveries = int(entry["times_delivered"]) + 1
            fields = claimed[0][1]
            if deliveries > self._max_deliveries:
                await self._dead_letter(stream, entry_id, fields, deliveries)
            else:
                logger.warning("rerunning %s from %s (delivery %d)", entry_id, stream, deliveries)
                await self._start(stream, entry_id, fields, attempt=deliveries)
        return len(orphaned)

    async def _dead_letter(self, stream: str, entry_id: bytes, fields: dict[bytes, bytes], deliveries: int) -> None:
        """Park the Submit, fail its request with the reason, tell its readers, acknowledge it."""
        submit = decode_submit(fields[b"m"])
        reason = f"delivered {deliveries} times; each worker running it stopped before it finished"
        error = ErrorInfo(ErrorCode.WORKER_LOST, reason)
        await self._redis.xadd(self._keys.dead_letters(self.model), {"m": fields[b"m"], "reason": reason})
        settlement = self.host.settlement(self._emitter(submit.request_id), self._settler(submit.request_id))
        await settlement.settle(submit, FinishedRequest.failed(error), attempt=deliveries)
        await self._ack(stream, entry_id)
        logger.error("dead-lettered request %s: %s", submit.request_id, reason)


async def _through_redis_faults(step: Callable[[], Awaitable[T]], what: str) -> T:
    """`step()`, retried with backoff through Redis faults for up to `EMIT_PATIENCE_S` (a Redis restart): a
    request's events and settlement wait for Redis instead of failing the request; past that, the fault is
    raised."""
    deadline, delay = time.monotonic() + EMIT_PATIENCE_S, RETRY_MIN_S
    while True:
        try:
            return await step()
        except Exception as error:
            if not is_redis_fault(error) or time.monotonic() + delay > deadline:
                raise
            logger.warning("%s failed (%s); retrying in %.1f s", what, error, delay)
            await asyncio.sleep(delay)
            delay = min(2 * delay, RETRY_MAX_S)


async def _subscribed(pubsub: PubSub, timeout_s: float = 5.0) -> None:
    """Wait for Redis to confirm the subscription (from then on, every message published reaches it)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        message = await pubsub.get_message(timeout=1.0)
        if message is not None and message["type"] == "subscribe":
            return
    raise redis.TimeoutError(f"no subscription confirmed within {timeout_s:g} s")


def _queue_event(pipe: Pipeline, stream: str, event: Event) -> None:
    """Append `event` to a request's stream (bounded), and push the stream's expiry back."""
    pipe.xadd(stream, {"m": encode(event)}, maxlen=EVENTS_MAXLEN, approximate=True)
    pipe.expire(stream, EVENTS_TTL_S)
