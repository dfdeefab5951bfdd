"""Tenant-affine routing: stable per tenant, spread over workers, spilling over when the preferred one is full,
moving only the tenants of a worker that leaves; and backpressure before anything is reserved."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from pagewise.platform.errors import APIError
from pagewise.platform.transports.redis import RedisTransport
from pagewise.serving.protocol import RedisKeys, WorkerHeartbeat


def _beat(
    worker_id: str, running: int = 0, waiting: int = 0, max_num_seqs: int = 8,
    tenants_waiting: dict[str, int] | None = None,
) -> WorkerHeartbeat:
    now = time.time()
    return WorkerHeartbeat(worker_id=worker_id, model="m", host="h", started_at=now, last_heartbeat=now,
                           running=running, waiting=waiting, max_num_seqs=max_num_seqs, kv_usage=0.0,
                           prefix_hit_rate=0.0, tenants_waiting=tenants_waiting)


def _transport(*beats: WorkerHeartbeat, affinity: bool = True, max_queue_depth: int = 100) -> RedisTransport:
    transport = RedisTransport(None, RedisKeys("t:"), "m", heartbeat_ttl_s=5, max_queue_depth=max_queue_depth,
                               affinity=affinity)
    transport._workers = list(beats)
    return transport


def test_a_tenant_sticks_to_one_worker_and_tenants_spread() -> None:
    transport = _transport(_beat("a"), _beat("b"), _beat("c"))
    picks = {f"ten_{i}": transport.route(f"ten_{i}").worker_id for i in range(60)}
    assert all(transport.route(t).worker_id == w for t, w in picks.items())
    assert set(picks.values()) == {"a", "b", "c"}


def test_each_adapter_of_a_tenant_sticks_to_one_worker_and_a_tenants_adapters_spread() -> None:
    """A tenant-adapter pair is routed where its adapter is already loaded: stable per pair, spread over the workers
    (not all on the tenant's own worker), spilling over like a tenant's requests when its worker is full."""
    transport = _transport(_beat("a"), _beat("b"), _beat("c"))
    digests = [f"{i:064x}" for i in range(30)]
    picks = {d: transport.route("ten_1", d).worker_id for d in digests}
    assert all(transport.route("ten_1", d).worker_id == w for d, w in picks.items())
    assert set(picks.values()) == {"a", "b", "c"}
    on_a = next(d for d, w in picks.items() if w == "a")
    full = _transport(_beat("a", running=8), _beat("b", running=1), _beat("c", running=5))
    assert full.route("ten_1", on_a).worker_id == "b"


def test_a_worker_leaving_moves_only_its_own_tenants() -> None:
    three = _transport(_beat("a"), _beat("b"), _beat("c"))
    two = _transport(_beat("a"), _beat("c"))
    for i in range(60):
        before = three.route(f"ten_{i}").worker_id
        if before != "b":
            assert two.route(f"ten_{i}").worker_id == before


def test_a_saturated_worker_spills_to_the_least_loaded() -> None:
    transport = _transport(_beat("a"), _beat("b"))
    tenant = next(f"ten_{i}" for i in range(100) if transport.route(f"ten_{i}").worker_id == "a")
    full = _transport(_beat("a", running=8), _beat("b", running=1))
    assert full.route(tenant).worker_id == "b"


def test_blind_routing_takes_the_least_loaded() -> None:
    transport = _transport(_beat("a", running=3), _beat("b", running=1), affinity=False)
    assert {transport.route(f"ten_{i}").worker_id for i in range(20)} == {"b"}


def test_backpressure_and_no_worker_are_503_with_retry_after() -> None:
    with pytest.raises(APIError) as none:
        _transport().check_capacity("ten_a")
    assert none.value.status_code == 503 and none.value.code == "engine_unavailable"
    assert "Retry-After" in none.value.headers
    with pytest.raises(APIError) as busy:
        _transport(_beat("a", waiting=60), _beat("b", waiting=41), max_queue_depth=100).check_capacity("ten_a")
    assert busy.value.status_code == 503 and busy.value.code == "overloaded"


def test_over_the_limit_a_flooding_tenant_is_refused_and_the_others_are_not() -> None:
    """Workers on the fair policy report per-tenant queues: the tenant holding the backlog is the one turned
    away; a tenant under its share of the limit still gets in, and its own Submits count against it."""
    beats = (_beat("a", waiting=70, tenants_waiting={"flood": 70}),
             _beat("b", waiting=40, tenants_waiting={"flood": 38, "calm": 2}))
    transport = _transport(*beats, max_queue_depth=100)
    with pytest.raises(APIError) as refused:
        transport.check_capacity("flood")
    assert refused.value.status_code == 503 and refused.value.code == "overloaded"
    assert "this tenant has 108 of them, its share is 50" in refused.value.message
    transport.check_capacity("calm")  # 2 waiting, share 50 among {flood, calm}
    transport.check_capacity("quiet")  # nothing waiting, share 33 among {flood, calm, quiet}
    for _ in range(31):
        transport._sent_since_beat.setdefault("a", Counter())["quiet"] += 1
    transport.check_capacity("quiet")  # 31 sent since the last heartbeat: still under 33
    transport._sent_since_beat["a"]["quiet"] += 3  # 34: over its share
    with pytest.raises(APIError):
        transport.check_capacity("quiet")


def test_over_the_limit_fcfs_workers_refuse_every_tenant() -> None:
    """A worker without per-tenant queues (FCFS) makes the limit global again."""
    transport = _transport(_beat("a", waiting=70, tenants_waiting={"flood": 70}), _beat("b", waiting=40),
                           max_queue_depth=100)
    for tenant in ("flood", "quiet"):
        with pytest.raises(APIError) as refused:
            transport.check_capacity(tenant)
        assert "limit 100" in refused.value.message
