"""KV-cache write and block-copy kernels in Triton.

Same semantics as ``reference.reshape_and_cache`` and ``reference.copy_blocks``.

Cache layout per layer: ``[num_blocks, num_kv_heads, block_size, head_dim]``; slot = ``block * block_size +
offset``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _launch_opts(**opts: int) -> dict[str, int]:
    return {} if triton.knobs.runtime.interpret else opts


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    """Program (token, head block): copy ``BLOCK_H`` heads of one token's K and V into its slot.

    A negative slot (padding) writes nothing. ``head_dim`` is the contiguous last dim of all four tensors, and
    key/value already have their cache's dtype.
    """
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_PAD)
    if HEAD_PAD == HEAD_DIM:  # noqa: SIM108  (all-true splat: accesses along head_dim stay vectorised)
        dim_ok = tl.full([HEAD_PAD], 1, tl.int1)
    else:
        dim_ok = dims < HEAD_DIM
    mask = (heads < NUM_KV_HEADS)[:, None] & dim_ok[None, :]

    k = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    inner_k = heads[:, None] * stride_kch + dims[None, :]
    inner_v = heads[:, None] * stride_vch + dims[None, :]
    k_dst = key_cache_ptr + block * stride_kcb + offset * stride_kcs + inner_k
    v_dst = value_cache_ptr + block * stride_vcb + offset * stride_vcs + inner_v
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots; slot -1 is skipped.

    Slots must be distinct (each cache position is written by at most one token). ``key``/``value`` may be
    strided views (e.g. slices of a fused QKV projection) as long as ``head_dim`` is contiguous.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    _, num_kv_heads, block_size, head_dim = key_cache.shape
    if key.shape != (num_tokens, num_kv_heads, head_dim) or value.shape != key.shape:
        raise ValueError(f"key/value {tuple(key.shape)} do not match cache {tuple(key_cache.shape)}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous")
    # A dtype change is done by torch (round-to-nearest-even everywhere, including the interpreter).
    key = key.to(key_cache.dtype)
    value = value.to(value_cache.dtype)
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    slot_mapping = slot_mapping.to(key.device).contiguous()
    head_pad = _next_pow2(head_dim)
    block_h = min(_next_pow2(num_kv_heads), max(1, 2048 // head_pad))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _reshape_and_cache_kernel[grid](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(2),
        value_cache.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        **_launch_opts(num_warps=4),
    )


@triton.jit
def _copy_blocks_kernel(
    first_cache_ptr,
    cache_ptrs_ptr,
    block_mapping_ptr,
    BLOCK_NUMEL: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """Program (cache, pair, chunk): copy ``CHUNK`` elements of block ``src`` to block ``dst`` in one cache.

    ``cache_ptrs_ptr`` holds the int64 base addresses of all caches (every layer's K then V); they share the
    dtype of ``first_cache_ptr`` and are contiguous with ``BLOCK_NUMEL`` elements per block.
    """
    cache = tl.program_id(0)
    pair = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    base = tl.load(cache_ptrs_ptr + cache).to(tl.pointer_type(first_cache_ptr.dtype.element_ty))
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    idx = chunk * CHUNK + tl.arange(0, CHUNK)
    if BLOCK_NUMEL % CHUNK == 0:
        data = tl.load(base + src * BLOCK_NUMEL + idx)
        tl.store(base + dst * BLOCK_NUMEL + idx, data)
    else:
        mask = idx < BLOCK_NUMEL
        data = tl.load(base + src * BLOCK_NUMEL + idx, mask=mask)
        tl.store(base + dst * BLOCK_NUMEL + idx, data, mask=mask)


_PTR_TABLES: dict[tuple[torch.device, tuple[int, ...]], torch.Tensor] = {}


def _pointer_table(caches: list[torch.Tensor]) -> torch.Tensor:
    """Device int64 tensor of the caches' base addresses (memoised: the engine reuses its cache tensors)."""
    device = caches[0].device
    key = (device, tuple(c.data_ptr() for c in caches))
    table = _PTR_TABLES.get(key)
    if table is None:
        if len(_PTR_TABLES) > 64:
            _PTR_TABLES.clear()
        table = torch.tensor(key[1], dtype=torch.int64, device=device)
        _PTR_TABLES[key] = table
    return table


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy blocks ``src -> dst`` for each ``[n, 2]`` pair of ``block_mapping`` in all layers, in one launch.

    Invariants: every cache is contiguous and has the same shape and dtype; destinations are distinct and no
    destination is also a source (copy-on-write targets are fresh blocks), so the parallel copies don't race.
    """
    if block_mapping.numel() == 0:
        return
    caches = [*key_caches, *value_caches]
    first = caches[0]
    for cache in caches:
        if cache.shape != first.shape or cache.dtype != first.dtype or cache.device != first.device:
            raise ValueError("all caches must share shape, dtype and device")
        if not cache.is_contiguous():
            raise ValueError("copy_blocks needs contiguous caches")
    mapping = block_mapping.to(device=first.device, dtype=torch.int64).contiguous()
    block_numel = first[0].numel()
    chunk = min(_next_pow2(block_numel), 4096)
    grid = (len(caches), mapping.shape[0], triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        first,
        _pointer_table(caches),
        mapping,
        BLOCK_NUMEL=block_numel,
        CHUNK=chunk,
        **_launch_opts(num_warps=4),
    )
