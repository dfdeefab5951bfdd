"""The engine's side of serving: runs Submits on one engine and keeps their claims alive.

Used as is by both transports — in the API's process (embedded mode, loopback) and in `pagewise worker`
(distributed mode) — so a request is executed, leased and settled by the same code in both.

Invariants:
- At most one live `Execution` per request id; `abort(id)` reaches it wherever it is, and an abort that comes
  before its Submit (`abort` on an unknown id, within `EARLY_ABORT_TTL_S`) still cancels it when it arrives.
- While an execution is live, the heartbeat renews its quota reservation and its row's lease every third of a
  lease. A host that dies stops renewing: its slots come back when the quota leases run out, and its rows are
  failed as orphans by any replica's sweep (or, in distributed mode, its Submits are redelivered first).
- Each settled request is counted once in the metrics, by the host whose final write it was.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pagewise.serving.adapter_store import AdapterStore
from pagewise.serving.execution import Execution
from pagewise.serving.ledgers import QuotaLedger, RequestLedger, SettlementObserver
from pagewise.serving.protocol import AdapterSupport, EngineInfo, EngineLimits, Event, Finished, Submit, WorkerHeartbeat
from pagewise.serving.settlement import Emit, Hold, ReconcileAndEmit, Settlement
from pagewise.serving.tokenizer_spec import tokenizer_spec

if TYPE_CHECKING:
    from pagewise.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)
BEATS_PER_LEASE = 3
EARLY_ABORT_TTL_S = 600.0


class EngineHost:
    def __init__(
        self,
        engine: AsyncLLMEngine,
        requests: RequestLedger,
        quotas: QuotaLedger,
        metrics: SettlementObserver | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        adapters: AdapterStore | None = None,
    ) -> None:
        """`adapters`: where tenants' adapters are stored (None: requests under an adapter are refused)."""
        self.engine = engine
        self.adapters = adapters
        self.requests = requests
        self.quotas = quotas
        self.metrics = metrics
        self.live: dict[str, Execution] = {}
        self._tasks: dict[str, asyncio.Task[Event]] = {}
        self._early_aborts: dict[str, float] = {}
        self._clock = clock
        self._heartbeat: asyncio.Task[None] | None = None
        self.started_at = time.time()
        self.hostname = socket.gethostname()

    def start(self) -> None:
        """Start the engine's loop and the lease heartbeat (idempotent)."""
        self.engine.start()
        if self._heartbeat is None:
            self._heartbeat = asyncio.get_running_loop().create_task(self._keep_leases())

    def run(
        self,
        submit: Submit,
        emit: Emit,
        *,
        attempt: int = 1,
        reconcile_and_emit: ReconcileAndEmit | None = None,
        hold: Hold | None = None,
    ) -> asyncio.Task[Event]:
        """Start executing `submit`; the task's result is the terminal event (already emitted), or `Superseded`.
        A request id that is already live gets that execution's task back (a duplicate delivery never runs twice
        at once). `reconcile_and_emit`: the transport's reconcile-then-emit in one step (without: `quotas.reconcile`,
        then `emit`); `hold`: whether the transport still gives this host the Submit (without: always)."""
        request_id = submit.request_id
        running = self._tasks.get(request_id)
        if running is not None:
            return running
        settlement = self.settlement(emit, reconcile_and_emit, hold)
        execution = Execution(submit, self.engine, settlement, attempt=attempt, adapters=self.adapters)
        if self._early_aborts.pop(request_id, None) is not None:
            execution.abort()
        self.live[request_id] = execution
        task = asyncio.get_running_loop().create_task(execution.run())
        self._tasks[request_id] = task
        task.add_done_callback(lambda t: self._done(execution, t))
        return task

    def settlement(
        self, emit: Emit | None, reconcile_and_emit: ReconcileAndEmit | None = None, hold: Hold | None = None
    ) -> Settlement:
        """How a request ends on this host's ledgers, told through a transport's hooks."""
        return Settlement(self.requests, self.quotas, emit, reconcile_and_emit, hold)

    def abort(self, request_id: str) -> bool:
        """Cancel a live request (True), or remember the abort for a Submit that has not arrived yet (False)."""
        execution = self.live.get(request_id)
        if execution is not None:
            execution.abort()
            return True
        now = self._clock()
        self._early_aborts = {k: t for k, t in self._early_aborts.items() if now - t < EARLY_ABORT_TTL_S}
        self._early_aborts[request_id] = now
        return False

    async def drain(self) -> None:
        """Abort every live request and wait until each is settled; stop the heartbeat."""
        for execution in list(self.live.values()):
            execution.abort()
        await asyncio.gather(*list(self._tasks.values()), return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
            self._heartbeat = None

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def engine_info(self, *, with_tokenizer: bool) -> EngineInfo:
        """What this engine serves; the tokenizer travels only to processes that have no model. It serves adapters
        when its engine has LoRA on and this host knows the adapter store."""
        own, config = self.engine.limits, self.engine.config
        serves_adapters = config.enable_lora and self.adapters is not None
        return EngineInfo(
            model=self.engine.model_name,
            limits=EngineLimits(own.vocab_size, own.max_model_len, own.max_num_seqs, own.kv_capacity_tokens),
            tokenizer=tokenizer_spec(self.engine.tokenizer) if with_tokenizer else None,
            aliases=config.served_names(self.engine.model_name)[1:],
            adapters=AdapterSupport(self.engine.arch, config.max_lora_rank) if serves_adapters else None,
        )

    def heartbeat(self, worker_id: str, model: str) -> WorkerHeartbeat:
        """This engine's state now, as a worker reports it."""
        stats = self.engine.stats()
        queries = stats.get("prefix_cache_queries", 0)
        fair = self.engine.config.scheduling_policy == "fair"
        tenants = {t: int(v["waiting"]) for t, v in stats.get("tenants", {}).items() if v["waiting"]}
        return WorkerHeartbeat(
            worker_id=worker_id,
            model=model,
            host=self.hostname,
            started_at=self.started_at,
            last_heartbeat=time.time(),
            running=int(stats.get("num_requests_running", 0)),
            waiting=int(stats.get("num_requests_waiting", 0)),
            max_num_seqs=self.engine.config.max_num_seqs,
            kv_usage=float(stats.get("kv_cache_usage_perc", 0.0)),
            prefix_hit_rate=stats.get("prefix_cache_hits", 0) / queries if queries else 0.0,
            stats={k: v for k, v in stats.items() if isinstance(v, int | float | str)},
            tenants_waiting=tenants if fair else None,
        )

    async def renew(self) -> None:
        """One heartbeat: extend every live execution's quota lease and row lease by one lease."""
        executions = list(self.live.values())
        if not executions:
            return
        await asyncio.gather(*(self.quotas.renew(e.submit.reservation) for e in executions))
        until = dt.datetime.now(dt.UTC) + dt.timedelta(seconds=self.quotas.lease_s)
        await self.requests.renew_leases([e.request_id for e in executions], until)

    async def _keep_leases(self) -> None:
        interval = self.quotas.lease_s / BEATS_PER_LEASE
        while True:
            await asyncio.sleep(interval)
            try:
                await self.renew()
            except Exception:  # noqa: BLE001 - a database or Redis hiccup must not stop the heartbeat
                logger.exception("lease heartbeat failed; retrying in %.0f s", interval)

    def _done(self, execution: Execution, task: asyncio.Task[Event]) -> None:
        request_id = execution.request_id
        self.live.pop(request_id, None)
        self._tasks.pop(request_id, None)
        if task.cancelled() or task.exception() is not None or self.metrics is None or not execution.won:
            return
        event = task.result()
        if isinstance(event, Finished):
            self.metrics.observe_settled(execution.submit, event)
