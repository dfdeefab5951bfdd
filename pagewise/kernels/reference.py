"""Torch reference implementations of the paged KV-cache ops (CPU path and test oracle).

Cache layout, per layer: ``[num_blocks, num_kv_heads, block_size, head_dim]`` for keys and for values
(head-major inside a block, so one head's slice of a block is contiguous). The slot of a token is
``block_id * block_size + offset``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into their slots; slot -1 is skipped."""
    valid = slot_mapping >= 0
    if not bool(valid.all()):
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    block_size = key_cache.shape[2]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """One sequence's first ``context_len`` tokens, head-major: ``[num_kv_heads, context_len, head_dim]``."""
    num_kv_heads, block_size, head_dim = cache.shape[1:]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())  # [n, kvh, bs, d]
    return blocks.transpose(0, 1).reshape(num_kv_heads, num_blocks * block_size, head_dim)[:, :context_len]


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` queries placed at the end of a ``k``-token context.

    query ``[q, num_heads, d]``; key/value ``[num_kv_heads, k, d]``; the i-th query sees keys ``0..k-q+i``.
    Computed in bf16 over a bf16 cache (the query rounded to it, as the decode kernels round theirs; the flash
    kernel keeps its scores, softmax and sums in fp32), in fp32 otherwise; the result has the query's dtype.
    On a CPU with bf16 dot products the bf16 product is several times the fp32 one's speed.
    """
    q_len, k_len = query.shape[0], key.shape[1]
    dtype = torch.bfloat16 if key.dtype == torch.bfloat16 else torch.float32
    q = query.to(dtype).transpose(0, 1)[None]  # [1, h, q, d]
    k, v = key.to(dtype)[None], value.to(dtype)[None]
    mask = None
    if q_len > 1 and q_len != k_len:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)
        mask = torch.arange(k_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=q_len > 1 and q_len == k_len, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).to(query.dtype)


_DECODE_BUCKET = 16


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. Sequences are sorted by length and batched in buckets (little padding);
    within a bucket each KV head's context is gathered with ``index_select`` over contiguous per-head block
    slices, so the gather is a run of memcpys and both matmuls run on contiguous operands."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    lens = seq_lens.tolist()
    order = sorted(range(num_seqs), key=lens.__getitem__)
    out = torch.empty(num_seqs, num_kv_heads, group, head_dim, dtype=torch.float32, device=query.device)
    queries = (query.float() * scale).view(num_seqs, num_kv_heads, group, head_dim)
    for begin in range(0, num_seqs, _DECODE_BUCKET):
        rows = order[begin : begin + _DECODE_BUCKET]
        width = -(-lens[rows[-1]] // block_size)
        index = torch.tensor(rows, device=query.device)
        blocks = block_tables.index_select(0, index.to(block_tables.device))[:, :width].flatten().long()
        context = width * block_size
        pad = torch.arange(context, device=query.device)[None, :] >= seq_lens.index_select(0, index)[:, None]
        q = queries.index_select(0, index)
        for head in range(num_kv_heads):
            keys = key_cache[:, head].index_select(0, blocks).view(len(rows), context, head_dim).float()
            values = value_cache[:, head].index_select(0, blocks).view(len(rows), context, head_dim).float()
            scores = torch.bmm(q[:, head], keys.transpose(1, 2))
            scores.masked_fill_(pad[:, None, :], float("-inf"))
            out[index, head] = torch.bmm(torch.softmax(scores, dim=-1), values)
    return out.view(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    decode: Callable[..., torch.Tensor] | None = None,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context (see DESIGN.md, "Kernels").

    query ``[num_tokens, num_heads, head_dim]``; ``seq_lens[s]`` counts sequence ``s``'s whole context including
    its new tokens; its queries are ``query[query_start_loc[s]:query_start_loc[s + 1]]`` and sit at the last
    positions of that context. Sequences with one query token (decode) are batched together — by ``decode``
    (same arguments as ``_decode_batch``, the default) — and the others (prefill chunks) are computed one by one.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    decoding = [s for s, q in enumerate(q_lens) if q == 1]
    if decoding:
        index = torch.tensor([starts[s] for s in decoding], device=query.device)
        rows = torch.tensor(decoding, device=block_tables.device)
        out[index] = (decode or _decode_batch)(
            query[index], key_cache, value_cache, block_tables[rows], seq_lens[rows], scale
        )
    for s, q_len in enumerate(q_lens):
        if q_len <= 1:
            continue
        keys = _gather_context(key_cache, block_tables[s], lens[s])
        values = _gather_context(value_cache, block_tables[s], lens[s])
        q = query[starts[s] : starts[s + 1]]
        out[starts[s] : starts[s + 1]] = _attend(q, keys, values, scale)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``weight * x / sqrt(mean(x²) + eps)`` over the last dimension, computed in fp32; the result in
    ``out_dtype`` (default: ``x``'s), converted once at the end."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h.to(x.dtype)).to(out_dtype or x.dtype)


def residual_add(residual: torch.Tensor, delta: torch.Tensor) -> None:
    """``residual += delta`` in place, ``delta`` converted to the residual's dtype first."""
    residual.add_(delta.to(residual.dtype))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of a 2-D ``x``: the first of tied maxima (a NaN's index where a row has one). ``max``'s
    indices are argmax's, in a third of its time on a [64, 49152] batch (2 threads of an AMX Xeon: 0.9 vs 2.4 ms)."""
    return x.max(dim=-1).indices


def rotary_embedding(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of query ``[tokens, heads, dim]`` and key ``[tokens, kv_heads, dim]``; token
    ``t`` uses row ``positions[t]`` of the ``[max_positions, dim]`` fp32 tables. Computed in fp32; new tensors in
    the inputs' dtype (a bf16 result rounded once)."""
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    q, k = query.float(), key.float()
    return (q * c + _rotate_half(q) * s).to(query.dtype), (k * c + _rotate_half(k) * s).to(key.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of a ``[rows, 2 * size]`` input holding gate then up, computed in fp32 and returned in
    the input's dtype (a bf16 result rounded once)."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    return F.silu(gate).mul_(up).to(gate_up.dtype)


def copy_blocks(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    """Copy whole blocks ``src -> dst`` for every ``[n, 2]`` pair of ``block_mapping``, in every layer."""
    if block_mapping.numel() == 0:
        return
    src = block_mapping[:, 0].long().to(key_caches[0].device)
    dst = block_mapping[:, 1].long().to(key_caches[0].device)
    for cache in (*key_caches, *value_caches):
        cache.index_copy_(0, dst, cache.index_select(0, src))


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Copy blocks between two caches, possibly on different devices: ``dst[d] = src[s]`` per ``(s, d)`` pair.

    The cross-device copy is blocking, so a host cache holds the blocks when this returns: a ``non_blocking``
    device-to-host copy would let ``index_copy_`` read its destination before the data landed.
    """
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device))
