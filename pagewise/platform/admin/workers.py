"""`GET /admin/workers` (admin scope): the live engines, as their latest heartbeats report them."""

from __future__ import annotations

import msgspec
from litestar import get

from pagewise.platform.keys.auth import requires_scope
from pagewise.platform.services import Services


class WorkerOut(msgspec.Struct, kw_only=True):
    worker_id: str
    model: str
    host: str
    started_at: int
    last_heartbeat: float
    running: int
    waiting: int
    max_num_seqs: int
    kv_usage: float
    prefix_hit_rate: float


class WorkerList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[WorkerOut]


def live_workers(services: Services) -> list[WorkerOut]:
    """Every live engine: the in-process one in embedded mode, each live `pagewise worker` otherwise."""
    return [
        WorkerOut(
            worker_id=w.worker_id,
            model=w.model,
            host=w.host,
            started_at=int(w.started_at),
            last_heartbeat=w.last_heartbeat,
            running=w.running,
            waiting=w.waiting,
            max_num_seqs=w.max_num_seqs,
            kv_usage=w.kv_usage,
            prefix_hit_rate=w.prefix_hit_rate,
        )
        for w in services.engine.transport.workers()
    ]


@get("/admin/workers", guards=[requires_scope("admin")], tags=["admin"])
async def list_workers(services: Services) -> WorkerList:
    """Worker id, model, host, start, last heartbeat, running / waiting sequences, KV usage, prefix hit rate."""
    return WorkerList(data=live_workers(services))
