"""Torch reference implementations of the paged KV-cache ops (CPU path and test oracle).

Cache layout, per layer: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and for values.
The slot of a token is ``block_id * block_size + offset``.
"""

from __future__ import annotations

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
    slots = slot_mapping.long()
    key_cache.view(-1, *key_cache.shape[2:]).index_copy_(0, slots, key.to(key_cache.dtype))
    value_cache.view(-1, *value_cache.shape[2:]).index_copy_(0, slots, value.to(value_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first ``context_len`` tokens of one sequence, contiguous: ``[context_len, num_kv_heads, head_dim]``."""
    block_size = cache.shape[1]
    num_blocks = (context_len + block_size - 1) // block_size
    blocks = cache.index_select(0, block_table[:num_blocks].long())
    return blocks.reshape(-1, *cache.shape[2:])[:context_len]


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` queries placed at the end of a ``k``-token context.

    query ``[q, num_heads, d]``; key/value ``[k, num_kv_heads, d]``; the i-th query sees keys ``0..k-q+i``.
    Computed in fp32; the result has the query's dtype.
    """
    q_len, k_len = query.shape[0], key.shape[0]
    q = query.float().transpose(0, 1)[None]  # [1, h, q, d]
    k = key.float().transpose(0, 1)[None]
    v = value.float().transpose(0, 1)[None]
    mask = None
    if q_len > 1 and q_len != k_len:
        q_pos = torch.arange(k_len - q_len, k_len, device=query.device)
        mask = torch.arange(k_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=q_len > 1 and q_len == k_len, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1).to(query.dtype)


def _decode_batch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence, all sequences in one padded batched matmul."""
    block_size = key_cache.shape[1]
    max_len = int(seq_lens.max())
    num_blocks = (max_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()
    keys = key_cache[table].flatten(1, 2)[:, :max_len]  # [b, max_len, kvh, d]
    values = value_cache[table].flatten(1, 2)[:, :max_len]
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_heads // num_kv_heads
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)
    k = keys.float().permute(0, 2, 3, 1)  # [b, kvh, d, L]
    scores = torch.matmul(q, k) * scale  # [b, kvh, group, L]
    pad = torch.arange(max_len, device=query.device)[None, :] >= seq_lens[:, None].to(query.device)
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, values.float().transpose(1, 2))  # [b, kvh, group, d]
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of each sequence's new tokens over its cached context (see DESIGN.md, "Kernels").

    query ``[num_tokens, num_heads, head_dim]``; ``seq_lens[s]`` counts sequence ``s``'s whole context including
    its new tokens; its queries are ``query[query_start_loc[s]:query_start_loc[s + 1]]`` and sit at the last
    positions of that context. Sequences with one query token (decode) are batched together; the others
    (prefill chunks) are computed one by one.
    """
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[s + 1] - starts[s] for s in range(len(lens))]
    decode = [s for s, q in enumerate(q_lens) if q == 1]
    if decode:
        index = torch.tensor([starts[s] for s in decode], device=query.device)
        rows = torch.tensor(decode, device=block_tables.device)
        out[index] = _decode_batch(
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
    """Copy blocks between two caches, possibly on different devices: ``dst[d] = src[s]`` per ``(s, d)`` pair."""
    if block_mapping.numel() == 0:
        return
    src_ids = block_mapping[:, 0].long().to(src.device)
    dst_ids = block_mapping[:, 1].long().to(dst.device)
    dst.index_copy_(0, dst_ids, src.index_select(0, src_ids).to(dst.device, non_blocking=True))
