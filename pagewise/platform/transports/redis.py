"""The distributed mode's transport: Submits to `pagewise worker` processes over Redis Streams.

- Routing keeps per-tenant prefix caches and adapter slots useful: a tenant's requests go to the live worker with
  the highest rendezvous score for (tenant, worker) — for (tenant, adapter, worker) when the request runs under one
  of the tenant's adapters, so each adapter of a tenant is loaded where its requests already went, and a tenant's
  adapters spread over the workers — stable while the set of workers is, and moving only the pairs of a worker
  that joins or leaves — unless that worker is saturated (its running + waiting sequences, plus what this
  replica sent it since its last heartbeat, reach `max_num_seqs`); then the least loaded live worker takes it.
  `affinity=False` routes every request to the least loaded worker (what a blind balancer does).
- Backpressure: when no worker is live, or the sequences waiting across live workers exceed `max_queue_depth`,
  `check_capacity` answers 503 with `Retry-After` before anything is reserved or written. Over the limit the
  refusal is tenant-fair where the workers run the fair policy (their heartbeats carry per-tenant queues): a
  tenant is still admitted while it has fewer waiting than an equal share of the limit among the backlogged
  tenants, so one tenant's backlog turns away that tenant, not the others. The queue can then exceed the limit by
  at most one share per tenant. Under FCFS every tenant is refused alike.
- Events are read from the request's own stream from its start, so any replica can serve a stream, a retry or a
  reconnect. Aborts are a key (seen by a worker that takes the Submit later) plus a pub/sub notice (seen at once).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import redis.asyncio as redis

from pagewise import tracing
from pagewise.engine.tokenizer import Tokenizer
from pagewise.platform.errors import APIError
from pagewise.serving.protocol import (
    EngineInfo,
    Event,
    Finished,
    RedisKeys,
    Rejected,
    Submit,
    WorkerHeartbeat,
    decode_event,
    encode,
)
from pagewise.serving.tokenizer_spec import tokenizer_from_spec

logger = logging.getLogger(__name__)
REFRESH_S = 0.5  # how often the worker list and the model's EngineInfo are re-read
ABORT_TTL_S = 3600
READ_BLOCK_MS = 1000


class RedisTransport:
    def __init__(
        self,
        client: redis.Redis,
        keys: RedisKeys,
        model: str,
        *,
        heartbeat_ttl_s: float,
        max_queue_depth: int,
        affinity: bool = True,
    ) -> None:
        self._redis = client
        self._keys = keys
        self._model = model
        self._ttl = heartbeat_ttl_s
        self._max_queue_depth = max_queue_depth
        self._affinity = affinity
        self._info: EngineInfo | None = None
        self._tokenizer: Tokenizer | None = None
        self._workers: list[WorkerHeartbeat] = []
        # worker id -> tenant -> sequences sent since the worker's heartbeat we last read
        self._sent_since_beat: dict[str, Counter[str]] = {}
        self._refresher: asyncio.Task[None] | None = None

    @classmethod
    def from_url(cls, url: str, prefix: str, model: str, **options: Any) -> RedisTransport:
        return cls(redis.Redis.from_url(url), RedisKeys(prefix), model, **options)

    # ---- what the engines serve

    def engine_info(self) -> EngineInfo | None:
        return self._info

    def tokenizer(self) -> Tokenizer | None:
        return self._tokenizer

    def workers(self) -> list[WorkerHeartbeat]:
        return list(self._workers)

    def stats(self) -> dict[str, Any]:
        """Every numeric engine stat summed over the live workers; KV usage is the mean."""
        total: dict[str, Any] = {}
        for worker in self._workers:
            for key, value in worker.stats.items():
                if isinstance(value, int | float) and not isinstance(value, bool):
                    total[key] = total.get(key, 0) + value
        if self._workers:
            total["kv_cache_usage_perc"] = sum(w.kv_usage for w in self._workers) / len(self._workers)
        total["num_workers"] = len(self._workers)
        return total

    def error(self) -> BaseException | None:
        return None  # workers come and go; readiness says whether one is live

    async def start(self) -> None:
        await self.refresh()
        self._refresher = asyncio.get_running_loop().create_task(self._keep_refreshing())

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
            await asyncio.gather(self._refresher, return_exceptions=True)
        await self._redis.aclose()

    async def refresh(self) -> None:
        """Re-read the live workers and, until it is known, the model's `EngineInfo`."""
        if self._info is None:
            raw = await self._redis.get(self._keys.info(self._model))
            if raw is not None:
                info = msgspec.msgpack.decode(raw, type=EngineInfo)
                if info.tokenizer is not None:
                    self._tokenizer = tokenizer_from_spec(info.tokenizer)
                self._info = info
                logger.info("serving %s from the workers that announced it", info.model)
        beats = await self._redis.hgetall(self._keys.workers(self._model))
        now = time.time()
        workers = [msgspec.msgpack.decode(raw, type=WorkerHeartbeat) for raw in beats.values()]
        fresh = [w for w in workers if now - w.last_heartbeat < self._ttl]
        previous = {w.worker_id: w.last_heartbeat for w in self._workers}
        for w in fresh:
            if previous.get(w.worker_id) != w.last_heartbeat:
                self._sent_since_beat.pop(w.worker_id, None)
        self._workers = sorted(fresh, key=lambda w: w.worker_id)

    async def _keep_refreshing(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - Redis hiccup: keep the last view and retry
                logger.exception("could not refresh the worker list")

    # ---- requests

    def check_capacity(self, tenant_id: str) -> None:
        if not self._workers:
            raise APIError(
                503,
                f"No engine worker serving '{self._model}' is live; retry shortly",
                code="engine_unavailable",
                headers={"Retry-After": "5"},
            )
        sent = Counter[str]()
        for counts in self._sent_since_beat.values():
            sent.update(counts)
        waiting = sum(w.waiting for w in self._workers) + sent.total()
        if waiting <= self._max_queue_depth:
            return
        if all(w.tenants_waiting is not None for w in self._workers):
            by_tenant = sent.copy()
            for w in self._workers:
                by_tenant.update(w.tenants_waiting or {})
            backlogged = {t for t, n in by_tenant.items() if n > 0} | {tenant_id}
            share = self._max_queue_depth / len(backlogged)
            if by_tenant[tenant_id] < share:
                return
            detail = f"this tenant has {by_tenant[tenant_id]} of them, its share is {share:.0f}"
        else:
            detail = f"limit {self._max_queue_depth}"
        raise APIError(
            503,
            f"The engines of '{self._model}' have {waiting} requests waiting ({detail}); retry shortly",
            code="overloaded",
            headers={"Retry-After": "2"},
        )

    def route(self, tenant_id: str, adapter_digest: str | None = None) -> WorkerHeartbeat:
        """The worker that takes `tenant_id`'s next request, under the adapter of `adapter_digest` if given (see
        the module docstring)."""
        self.check_capacity(tenant_id)
        affinity_key = tenant_id if adapter_digest is None else f"{tenant_id}\x00{adapter_digest}"

        def load(w: WorkerHeartbeat) -> int:
            return w.load + self._sent_since_beat.get(w.worker_id, Counter()).total()

        if self._affinity:
            preferred = max(self._workers, key=lambda w: _rendezvous(affinity_key, w.worker_id))
            if load(preferred) < preferred.max_num_seqs:
                return preferred
        return min(self._workers, key=lambda w: (load(w) / max(w.max_num_seqs, 1), w.worker_id))

    async def submit(self, submit: Submit) -> None:
        worker = self.route(submit.tenant_id, None if submit.adapter is None else submit.adapter.digest)
        inbox = self._keys.submissions(worker.worker_id)
        with tracing.enqueue_span(submit, "redis", inbox) as traced:
            await self._redis.xadd(inbox, {"m": encode(traced)})
        self._sent_since_beat.setdefault(worker.worker_id, Counter())[submit.tenant_id] += max(1, len(submit.prompts))

    async def events(self, request_id: str) -> AsyncIterator[Event]:
        stream, last = self._keys.events(request_id), "0-0"
        while True:
            reply = await self._redis.xread({stream: last}, count=256, block=READ_BLOCK_MS)
            for _, entries in reply:
                for entry_id, fields in entries:
                    last = entry_id
                    event = decode_event(fields[b"m"])
                    yield event
                    if isinstance(event, Finished | Rejected):
                        return

    async def abort(self, request_id: str) -> None:
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.set(self._keys.aborted(request_id), 1, ex=ABORT_TTL_S)
            pipe.publish(self._keys.aborts(self._model), request_id)
            await pipe.execute()


def _rendezvous(affinity_key: str, worker_id: str) -> int:
    digest = hashlib.blake2b(f"{affinity_key}\x00{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
