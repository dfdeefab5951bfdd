"""Exact block states of the pool and the KV cache manager (in the style of vLLM's test_prefix_caching)."""

from __future__ import annotations

import pytest

from pagewise.engine.block_pool import BlockPool, hash_block_tokens
from pagewise.engine.kv_cache_manager import KVCacheManager
from pagewise.engine.request import Request
from pagewise.engine.sampling_params import SamplingParams

BS = 4


def make_request(tokens: list[int], rid: str = "r", tenant: str | None = None, seq: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), seq, tenant)


def free_order(pool: BlockPool) -> list[int]:
    return [b.block_id for b in pool.free_queue]


def refs(pool: BlockPool, ids: list[int]) -> list[int]:
    return [pool.blocks[i].ref_count for i in ids]


def admit(kv: KVCacheManager, request: Request) -> int:
    """Prefix lookup + allocation for the whole prompt; returns the number of cached tokens."""
    prefix = kv.lookup_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens - len(prefix) * BS, prefix)
    cached = request.num_computed_tokens
    request.num_computed_tokens = request.num_tokens
    kv.register_full_blocks(request)
    return cached


def test_free_queue_is_lru_with_o1_removal() -> None:
    pool = BlockPool(5)
    assert free_order(pool) == [0, 1, 2, 3, 4]
    taken = pool.allocate(3)
    assert [b.block_id for b in taken] == [0, 1, 2]
    assert free_order(pool) == [3, 4]
    pool.free(reversed(taken))
    assert free_order(pool) == [3, 4, 2, 1, 0]
    pool.touch([pool.blocks[1]])  # removal from the middle
    assert free_order(pool) == [3, 4, 2, 0]
    assert pool.blocks[1].ref_count == 1
    with pytest.raises(ValueError, match="need 5 free blocks, have 4"):
        pool.allocate(5)
    assert pool.num_free == 4


def test_a_growing_request_keeps_its_blocks_together_in_extents() -> None:
    pool = BlockPool(16, extent_blocks=4)
    kv = KVCacheManager(pool, BS)
    a, b = make_request(list(range(8)), "a"), make_request(list(range(100, 108)), "b", seq=1)
    assert kv.allocate_slots(a, 8) and kv.allocate_slots(b, 8)
    assert a.block_ids == [0, 1] and b.block_ids == [4, 5]  # b starts a wholly free extent, not at block 2
    for _turn in range(3):  # decode in turns: each grows after its own last block
        for request in (a, b):
            request.num_computed_tokens = request.num_tokens
            for _ in range(BS):
                request.append_token(7)
            assert kv.allocate_slots(request, BS)
    assert a.block_ids == [0, 1, 2, 3, 8] and b.block_ids == [4, 5, 6, 7, 12]  # next: a wholly free extent
    assert pool.check_extents() == []


def test_placement_runs_into_a_wholly_free_neighbour_and_falls_back_to_the_lru_head() -> None:
    pool = BlockPool(10, extent_blocks=4)  # extents [0-3] [4-7] [8-9]
    assert [b.block_id for b in pool.allocate(6)] == [0, 1, 2, 3, 4, 5]  # extent 1 was wholly free
    assert [b.block_id for b in pool.allocate(1)] == [8]
    pool.free([pool.blocks[i] for i in (1, 0)])  # extent 0 is partly free: placement no longer starts there
    assert [b.block_id for b in pool.allocate(1, after=8)] == [9]
    # No wholly free extent remains: the LRU head (6, never taken), then the block after each.
    assert [b.block_id for b in pool.allocate(2)] == [6, 7]
    assert [b.block_id for b in pool.allocate(2)] == [1, 0]  # every free block is served, least recent first
    assert pool.num_free == 0 and pool.check_extents() == []
    with pytest.raises(ValueError, match="extent_blocks must be at least 1"):
        BlockPool(4, extent_blocks=0)


@pytest.mark.parametrize("caching", [True, False])
def test_a_run_continues_into_a_free_neighbour_only_if_it_holds_no_cached_prefix(caching) -> None:
    pool = BlockPool(12, caching, extent_blocks=4)  # extents [0-3] [4-7] [8-11]
    kv = KVCacheManager(pool, BS)
    grower, younger, older = (make_request(list(range(k, k + 16)), f"r{k}", seq=k) for k in (0, 100, 200))
    for request in (grower, younger, older):
        admit(kv, request)
    assert [r.block_ids[0] for r in (grower, younger, older)] == [0, 4, 8]
    kv.free(older)
    kv.free(younger)  # extent 1 is the younger wholly free extent; with caching on its blocks hold a prefix
    grower.append_token(7)
    assert kv.allocate_slots(grower, 1)
    assert grower.block_ids[-1] == (8 if caching else 4)
    again = make_request(list(range(100, 116)) + [1], "again", seq=9)
    assert admit(kv, again) == (16 if caching else 0)  # the younger prefix is still whole


def test_extents_are_reused_in_the_order_they_became_wholly_free() -> None:
    pool = BlockPool(12, extent_blocks=4)
    first, second, third = (pool.allocate(1) for _ in range(3))
    assert [b[0].block_id for b in (first, second, third)] == [0, 4, 8]
    pool.free(second)
    pool.free(first)
    assert [b.block_id for b in pool.allocate(1)] == [4]  # freed before extent 0
    assert [b.block_id for b in pool.allocate(1)] == [0]


def test_new_blocks_after_a_prefix_hit_start_their_own_extent() -> None:
    pool = BlockPool(16, extent_blocks=4)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(10))
    first = make_request(prompt, "a")
    admit(kv, first)
    assert first.block_ids == [0, 1, 2]
    kv.free(first)  # blocks 0 and 1 stay cached; block 2 (partial) is free and unhashed
    second = make_request(prompt[:8] + [50, 51, 52, 53, 54], "b", seq=1)
    assert admit(kv, second) == 8
    assert second.block_ids == [0, 1, 4, 5]  # not block 2: it sits in the extent of the request that computed them
    assert pool.check_extents() == []


def test_double_free_raises() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="ref count 0"):
        pool.free([block])


def test_allocation_grows_one_block_at_a_time() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    request = make_request(list(range(6)))
    assert kv.allocate_slots(request, 6)
    assert request.block_ids == [0, 1]
    request.num_computed_tokens = 6
    for token in (6, 7):  # fills block 1; no new block
        request.append_token(token)
        assert kv.allocate_slots(request, 1)
        request.num_computed_tokens += 1
        assert request.block_ids == [0, 1]
    request.append_token(8)
    assert kv.allocate_slots(request, 1)
    assert request.block_ids == [0, 1, 2]


def test_prefix_hit_exact_state_and_eviction_order() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(10))  # blocks [0..3] [4..7] + partial [8, 9]
    first = make_request(prompt, "a")
    assert admit(kv, first) == 0
    assert first.block_ids == [0, 1, 2]
    h0 = hash_block_tokens(None, prompt[0:4], (None,))
    h1 = hash_block_tokens(h0, prompt[4:8])
    assert first.block_hashes == [h0, h1]
    assert pool.blocks[0].block_hash == h0 and pool.blocks[1].block_hash == h1
    assert pool.blocks[2].block_hash is None  # partial block is never cached

    second = make_request(prompt + [99], "b", seq=1)
    assert admit(kv, second) == 8
    assert second.block_ids == [0, 1, 3]
    assert refs(pool, [0, 1, 2, 3]) == [2, 2, 1, 1]

    kv.free(first)
    assert refs(pool, [0, 1, 2]) == [1, 1, 0]
    assert free_order(pool) == [4, 5, 6, 7, 8, 9, 2]
    kv.free(second)
    # tail first: block 3 (tail), then 1, then 0 -> the tail is evicted before the head
    assert free_order(pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert pool.lookup(h0) is pool.blocks[0] and pool.lookup(h1) is pool.blocks[1]

    third = make_request(prompt[:8] + [7, 7], "c", seq=2)
    assert admit(kv, third) == 8  # freed blocks stay hittable
    assert third.block_ids == [0, 1, 4]
    assert free_order(pool) == [5, 6, 7, 8, 9, 2, 3]


def test_hit_never_covers_last_token() -> None:
    kv = KVCacheManager(BlockPool(10), BS)
    prompt = list(range(8))
    admit(kv, make_request(prompt, "a"))
    again = make_request(prompt, "b", seq=1)
    assert admit(kv, again) == 4  # 8 tokens cached, but the last one must be recomputed


def test_tenant_salt_separates_caches() -> None:
    pool = BlockPool(20)
    kv = KVCacheManager(pool, BS)
    prompt = list(range(9))
    admit(kv, make_request(prompt, "a", tenant="acme"))
    assert admit(kv, make_request(prompt, "b", tenant="globex", seq=1)) == 0  # other tenant misses
    assert admit(kv, make_request(prompt, "c", tenant="acme", seq=2)) == 8  # same tenant hits
    assert admit(kv, make_request(prompt, "d", tenant=None, seq=3)) == 0  # no tenant is its own namespace


def test_eviction_removes_hash() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    first = make_request(list(range(8)), "a")
    admit(kv, first)
    kv.free(first)
    assert free_order(pool) == [2, 1, 0] and len(pool.cached) == 2
    other = make_request(list(range(100, 111)), "b", seq=1)
    admit(kv, other)  # needs all 3 blocks: evicts both cached ones
    assert other.block_ids == [2, 1, 0]
    assert set(pool.cached) == set(other.block_hashes)
    assert kv.lookup_prefix(make_request(list(range(9)), "c", seq=2)) == []


def test_allocation_failure_changes_nothing() -> None:
    pool = BlockPool(3)
    kv = KVCacheManager(pool, BS)
    request = make_request(list(range(20)))
    assert not kv.allocate_slots(request, 20)
    assert request.block_ids == [] and pool.num_free == 3


def test_fork_and_copy_on_write() -> None:
    pool = BlockPool(10)
    kv = KVCacheManager(pool, BS)
    parent = make_request(list(range(6)), "p")
    admit(kv, parent)
    child = make_request(list(range(6)), "c")
    kv.fork(parent, child)
    child.num_computed_tokens = 6
    assert child.block_ids == parent.block_ids == [0, 1]
    assert refs(pool, [0, 1]) == [2, 2]
    parent.append_token(50)
    assert kv.allocate_slots(parent, 1)  # writes into shared partial block 1: copy it
    assert parent.block_ids == [0, 2]
    ops = kv.take_block_ops()
    assert [(op.kind, op.src, op.dst) for op in ops] == [("copy", 1, 2)]
    assert refs(pool, [0, 1, 2]) == [2, 1, 1]
    child.append_token(60)
    assert kv.allocate_slots(child, 1)  # now the only owner of block 1: writes in place
    assert child.block_ids == [0, 1] and kv.take_block_ops() == []
    kv.free(parent)
    kv.free(child)
    assert pool.num_free == 10


def test_swap_out_and_in() -> None:
    pool = BlockPool(6)
    kv = KVCacheManager(pool, BS, num_swap_slots=2)
    request = make_request(list(range(7)))
    admit(kv, request)
    assert request.block_ids == [0, 1]
    assert kv.swap_out(request)
    assert request.block_ids == [] and pool.num_free == 6
    assert [(o.kind, o.src, o.dst) for o in kv.take_block_ops()] == [("swap_out", 0, 0), ("swap_out", 1, 1)]
    third = make_request(list(range(3)), "x", seq=1)
    admit(kv, third)
    assert not kv.swap_out(third)  # no host slots left: nothing changes
    assert third.block_ids == [2] and kv.take_block_ops() == []
    pool.allocate(4)
    assert not kv.swap_in(request)
    assert request.swap_slots == [0, 1]


def test_reset_prefix_cache_only_when_no_block_is_in_use() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS)
    live = make_request(list(range(9)))
    admit(kv, live)
    hashes = {b.block_id: b.block_hash for b in pool.blocks}
    cached = dict(pool.cached)
    assert len(cached) == 2
    assert pool.reset_prefix_cache() is False  # live blocks stay hittable: refused, nothing changed
    assert pool.cached == cached and {b.block_id: b.block_hash for b in pool.blocks} == hashes
    assert free_order(pool) == [3]
    kv.free(live)
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    assert free_order(pool) == [3, 2, 1, 0]


def test_check_accounting_finds_a_leak() -> None:
    pool = BlockPool(4)
    kv = KVCacheManager(pool, BS, num_swap_slots=2)
    request = make_request(list(range(6)))
    admit(kv, request)
    kv.check_accounting([request])
    pool.allocate(1)  # held by nobody
    with pytest.raises(RuntimeError, match=r"accounting is broken: ref counts wrong for blocks \[2\]"):
        kv.check_accounting([request])


def test_check_accounting_finds_wrong_extent_bookkeeping() -> None:
    pool = BlockPool(8, extent_blocks=4)
    kv = KVCacheManager(pool, BS)
    request = make_request(list(range(6)))
    admit(kv, request)
    pool.blocks[5].ref_count = 1  # a reference that bypassed the pool: ref counts and extent 1 both disagree
    pool.free_queue.remove(pool.blocks[5])
    with pytest.raises(RuntimeError, match=r"in-use counts wrong for extents \[1\]"):
        kv.check_accounting([request])
