"""Property-based test: random arrivals, forks, aborts, budgets and memory pressure through the real scheduler
and KV cache manager (the model is simulated: a scheduled prefill/decode just computes its tokens).

Checked after every step: blocks are conserved; each block's ref count equals the number of live requests that
hold it (so it never goes negative); a block that is written this step is owned by one request only; a running
request holds exactly the blocks its computed tokens need; and at the end every block is free again.

Some steps are paused before they are applied, and interrupting steps (``schedule_interrupt``) run meanwhile, with
aborts of requests outside the paused step: an interrupting step writes and reads no block of the paused step,
and the paused step's requests keep their blocks and their state until it is applied."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from pagewise.engine.block_pool import BlockPool
from pagewise.engine.kv_cache_manager import KVCacheManager
from pagewise.engine.request import Request, RequestStatus
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def check_invariants(scheduler: Scheduler, pool: BlockPool, live: list[Request], in_flight=()) -> None:
    holders = Counter(b for r in live for b in r.block_ids)
    in_queue = {b.block_id for b in pool.free_queue}
    assert len(in_queue) == pool.num_free
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0) >= 0
        assert (block.ref_count == 0) == (block.block_id in in_queue)
    assert pool.check_extents() == []
    for request in scheduler.running:
        assert request in in_flight or (
            len(request.block_ids) == -(-request.num_computed_tokens // BS)
            or request.num_computed_tokens == 0
        )


def check_writes_exclusive(pool: BlockPool, step) -> None:
    """A written block belongs to its writer alone — or also to the samples forked from it in this very step,
    which want exactly the prompt KV being written."""
    forks = Counter(step.sample_sources.values())
    for request, num_new in step.scheduled.items():
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            assert pool.blocks[request.block_ids[pos // BS]].ref_count == 1 + forks[request]


def written_blocks(step: SchedulerOutput) -> set[int]:
    return {
        request.block_ids[pos // BS]
        for request, num_new in step.scheduled.items()
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new)
    }


def check_apart(paused: SchedulerOutput, interrupting: SchedulerOutput, held: dict[Request, list[int]]) -> None:
    """The interrupting step touches none of the paused step's requests, holds (so reads) no block the paused step
    writes, writes no block of the paused step, and the paused step's requests are as they were."""
    assert not set(interrupting.scheduled) & set(paused.scheduled)
    assert not interrupting.preempted
    assert {op.kind for op in interrupting.block_ops} <= {"copy"}
    paused_blocks = {b for blocks in held.values() for b in blocks}
    being_written = {b for r, blocks in held.items() for b in blocks[r.num_computed_tokens // BS :]}
    for request in interrupting.scheduled:
        assert not set(request.block_ids) & being_written
    assert not written_blocks(interrupting) & paused_blocks
    for op in interrupting.block_ops:
        assert op.dst not in paused_blocks
    for request, blocks in held.items():
        assert request.status is RequestStatus.RUNNING and request.block_ids == blocks


def run_step(step: SchedulerOutput, scheduler: Scheduler, live: list[Request], rng: random.Random) -> None:
    """Simulate the model: compute the scheduled tokens, sample a token where a sequence caught up."""
    kv = scheduler.kv
    for request, num_new in step.scheduled.items():
        request.num_computed_tokens += num_new
        kv.register_full_blocks(request)
    for request in step.scheduled:
        if request.num_computed_tokens == request.num_tokens:
            request.append_token(rng.randrange(50))
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request)
                live.remove(request)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    num_blocks=st.integers(12, 40),
    budget=st.sampled_from([3, 8, 16, 64]),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    max_num_seqs=st.integers(2, 8),
    policy=st.sampled_from(["fcfs", "fair"]),
    extent=st.sampled_from([1, 2, 4, 5]),
)
def test_scheduler_invariants(seed, num_blocks, budget, mode, caching, max_num_seqs, policy, extent) -> None:
    rng = random.Random(seed)
    pool = BlockPool(num_blocks, caching, extent)
    kv = KVCacheManager(pool, BS, num_swap_slots=rng.choice([0, 4, 64]))
    scheduler = Scheduler(kv, max_num_seqs, budget, enable_chunked_prefill=True, preemption_mode=mode, policy=policy)
    shared_prefix = [rng.randrange(50) for _ in range(9)]
    live: list[Request] = []
    arrivals = 0
    for _ in range(150):
        if arrivals < 20 and rng.random() < 0.4:
            prompt = (shared_prefix if rng.random() < 0.5 else []) + [
                rng.randrange(50) for _ in range(rng.randint(1, 12))
            ]
            n = rng.choice([1, 1, 2, 3]) if max_num_seqs >= 3 else 1
            max_tokens = rng.randint(1, 10)
            group = [
                Request(
                    f"r{arrivals}#{i}",
                    prompt,
                    SamplingParams(max_tokens=max_tokens),
                    arrivals,
                    rng.choice(["a", "b", "c"]),
                    sample_index=i,
                    priority=rng.choice([0, 0, 1]),
                )
                for i in range(n)
            ]
            capacity = num_blocks * BS
            if len(prompt) + max_tokens <= capacity:
                scheduler.add_request(group[0], group[1:], tenant_weight=rng.choice([1.0, 2.0]))
                live.extend(group)
            arrivals += 1
        if live and rng.random() < 0.05:
            victim = rng.choice(live)
            scheduler.finish(victim)
            live.remove(victim)
        step = scheduler.schedule()
        check_writes_exclusive(pool, step)
        held = {r: list(r.block_ids) for r in step.scheduled}
        for _ in range(rng.choice([0, 0, 1, 3])):  # the step is paused; interrupting steps run
            interrupting = scheduler.schedule_interrupt(step, rng.choice([1, 4, 16]), anyone=rng.random() < 0.7)
            check_writes_exclusive(pool, interrupting)
            check_apart(step, interrupting, held)
            run_step(interrupting, scheduler, live, rng)
            outside = [r for r in live if r.group_id not in {p.group_id for p in step.scheduled}]
            if outside and rng.random() < 0.2:
                victim = rng.choice(outside)
                scheduler.finish(victim)
                live.remove(victim)
            check_invariants(scheduler, pool, live, in_flight=held)
            check_apart(step, SchedulerOutput(), held)
        run_step(step, scheduler, live, rng)
        scheduler.complete(step)
        check_invariants(scheduler, pool, live)
        if not live and arrivals >= 20:
            break
    for request in list(live):
        scheduler.finish(request)
    assert all(r.status is RequestStatus.FINISHED for r in live)
    assert pool.num_free == num_blocks
    assert scheduler.num_unfinished == 0
    assert kv.swap.num_slots == len(kv.swap.free_slots)
