"""The torch reference ops against plain dense computations on contiguous tensors (oracle of the oracle)."""

from __future__ import annotations

import random

import pytest
import torch

from pagewise.kernels import reference


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / expected.double().abs().max().clamp_min(1e-30))


def dense_causal_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """fp64 attention of ``q`` queries at the last ``q`` positions of a contiguous ``k``-token context.

    query ``[q, num_heads, d]``; key/value ``[k, num_kv_heads, d]``; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``; query ``i`` sees keys ``0 .. k - q + i``.
    """
    q_len, num_heads, _ = query.shape
    k_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    q_pos = torch.arange(k_len - q_len, k_len)
    hidden = torch.arange(k_len)[None, :] > q_pos[:, None]
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


def check_against_dense(batch, out: torch.Tensor) -> None:
    for s in range(len(batch.keys)):
        expected = dense_causal_attention(batch.queries_of(s), batch.keys[s], batch.values[s], batch.scale)
        start, end = batch.query_start_loc[s : s + 2].tolist()
        assert rel_err(out[start:end], expected) <= 1e-5, f"sequence {s}"


CASES = {
    # name: (seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    "decode": ([1, 15, 16, 17, 70], [1, 1, 1, 1, 1], 4, 4, 64, 16),
    "prefill": ([9, 33], [9, 33], 6, 2, 80, 8),
    "prefill_after_prefix": ([40, 65], [8, 1 + 32], 8, 1, 96, 32),
    "mixed_gqa": ([1, 7, 30, 20, 12, 64], [1, 1, 9, 20, 1, 17], 8, 2, 128, 16),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_dense(case: str, paged_batch) -> None:
    batch = paged_batch(*CASES[case], seed=hash(case) % 1000)
    out = batch.attend(reference.paged_attention)
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    check_against_dense(batch, out)


@pytest.mark.parametrize("seed", range(12))
def test_paged_attention_random_shapes(seed: int, paged_batch) -> None:
    rng = random.Random(seed)
    num_kv_heads = rng.choice([1, 2, 4])
    group = rng.choice([1, 2, 3, 8])
    block_size = rng.choice([8, 16, 32])
    seq_lens, q_lens = [], []
    for _ in range(rng.randint(1, 5)):
        n = rng.choice([1, block_size - 1, block_size, block_size + 1, rng.randint(1, 4 * block_size)])
        seq_lens.append(n)
        q_lens.append(rng.choice([1, n, rng.randint(1, n)]))  # decode, full prefill, chunk after a prefix
    batch = paged_batch(
        seq_lens,
        q_lens,
        num_kv_heads * group,
        num_kv_heads,
        rng.choice([64, 80, 96, 128]),
        block_size,
        seed=seed,
    )
    out = batch.attend(reference.paged_attention)
    check_against_dense(batch, out)


def test_reshape_and_cache_writes_slots_and_skips_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads, dim = 5, 8, 2, 16
    key_cache = torch.full((num_blocks, heads, block_size, dim), float("nan"))
    value_cache = key_cache.clone()
    slots = torch.tensor([3, -1, 17, 39, -1, 8])
    key = torch.randn(len(slots), heads, dim, generator=gen)
    value = torch.randn(len(slots), heads, dim, generator=gen)
    reference.reshape_and_cache(key, value, key_cache, value_cache, slots)
    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        written[block, offset] = True
        assert torch.equal(key_cache[block, :, offset], key[t])
        assert torch.equal(value_cache[block, :, offset], value[t])
    unwritten = ~written[:, None, :].expand(-1, heads, -1)
    assert key_cache[unwritten].isnan().all() and value_cache[unwritten].isnan().all()


def test_copy_and_swap_blocks() -> None:
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(6, 4, 2, 8, generator=gen) for _ in range(4)]
    before = [c.clone() for c in caches]
    mapping = torch.tensor([[0, 3], [5, 1]])
    reference.copy_blocks(caches[:2], caches[2:], mapping)
    for cache, old in zip(caches, before, strict=True):
        expected = old.clone()
        expected[3], expected[1] = old[0], old[5]
        assert torch.equal(cache, expected)

    dst = torch.zeros(3, 4, 2, 8)
    reference.swap_blocks(caches[0], dst, torch.tensor([[2, 0], [4, 2]]))
    assert torch.equal(dst[0], caches[0][2]) and torch.equal(dst[2], caches[0][4])
    assert not dst[1].any()


def test_prefill_over_a_bf16_cache_runs_in_bf16(paged_batch) -> None:
    """Prefill rows over a bf16 cache: attention of the query rounded to bf16 over the bf16 rows (the flash
    kernel's fp32 scores and sums), within bf16 rounding of the dense attention of those rounded operands — and
    not the fp32 computation (it did run in bf16)."""
    batch = paged_batch(*CASES["mixed_gqa"], seed=5)
    caches = [cache.bfloat16() for cache in (batch.key_cache, batch.value_cache)]
    out = batch.attend(reference.paged_attention, *caches)
    fp32 = batch.attend(reference.paged_attention, *(cache.float() for cache in caches))
    starts = batch.query_start_loc.tolist()
    prefill = [s for s in range(len(starts) - 1) if starts[s + 1] - starts[s] > 1]
    assert prefill
    for s in prefill:
        rows = slice(starts[s], starts[s + 1])
        rounded = [t.bfloat16().float() for t in (batch.queries_of(s), batch.keys[s], batch.values[s])]
        assert rel_err(out[rows], dense_causal_attention(*rounded, batch.scale)) <= 2e-2, f"sequence {s}"
        assert (out[rows] - fp32[rows]).abs().max() > 1e-4, f"sequence {s} ran in fp32"
