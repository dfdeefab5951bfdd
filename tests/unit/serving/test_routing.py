"""Tenant-affine routing: stable per tenant, spread over workers, spilling over when the preferred one is full,
moving only the tenants of a worker that leaves; and backpressure before anything is reserved."""

from __future__ import annotations

import time

import pytest

from pagewise.platform.errors import APIError
from pagewise.platform.transports.redis import RedisTransport
from pagewise.protocol import RedisKeys, WorkerHeartbeat


def _beat(worker_id: str, running: int = 0, waiting: int = 0, max_num_seqs: int = 8) -> WorkerHeartbeat:
    now = time.time()
    return WorkerHeartbeat(worker_id=worker_id, model="m", host="h", started_at=now, last_heartbeat=now,
                           running=running, waiting=waiting, max_num_seqs=max_num_seqs, kv_usage=0.0,
                           prefix_hit_rate=0.0)


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
        _transport().check_capacity()
    assert none.value.status_code == 503 and none.value.code == "engine_unavailable"
    assert "Retry-After" in none.value.headers
    with pytest.raises(APIError) as busy:
        _transport(_beat("a", waiting=60), _beat("b", waiting=41), max_queue_depth=100).check_capacity()
    assert busy.value.status_code == 503 and busy.value.code == "overloaded"
