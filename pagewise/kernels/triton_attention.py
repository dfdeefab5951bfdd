"""Paged attention in Triton: one kernel family serving prefill, chunked prefill, prefix hits and decode.

Layout and semantics are those of ``reference.paged_attention`` (DESIGN.md, "Kernels"):

* ``query``/``out`` ``[num_tokens, num_heads, head_dim]``; caches ``[num_blocks, num_kv_heads, block_size,
  head_dim]``; ``block_tables [num_seqs, max_blocks]``; ``seq_lens [num_seqs]`` counts the whole context
  including the new tokens; ``query_start_loc [num_seqs + 1]`` delimits each sequence's new tokens.
* The i-th of a sequence's ``q`` new tokens sits at position ``seq_len - q + i`` and attends to positions
  ``0 .. seq_len - q + i`` (causal within the new tokens, full over the cached prefix).

How the work is cut:

* A *tile* is ``BLOCK_Q`` consecutive new tokens of one sequence times the ``GROUP`` query heads that share
  one KV head (padded to a power of two), i.e. ``BLOCK_M = BLOCK_Q * GROUP_PAD`` rows of one ``tl.dot``.
  Loading K/V once per KV head and using it for the whole query-head group is what makes GQA cheap.
* Tiles are numbered without a host sync: sequence ``s`` owns tiles ``query_start_loc[s] // BLOCK_Q + s ...``
  (an upper bound of ``ceil(q_len / BLOCK_Q)`` tiles each); the grid is ``num_tokens // BLOCK_Q + num_seqs``
  tiles, each program finds its sequence by binary search over ``query_start_loc`` and surplus programs exit.
* K/V are read ``TILE_N`` context positions at a time; every position looks up its physical block in the block
  table, so ``TILE_N`` is independent of the cache block size (8, 16, 32 all work) and blocks need not be
  contiguous or ordered.
* Softmax is online (running max ``m``, running sum ``l``, rescaled accumulator) in fp32.
* Split-context ("flash-decoding"): the grid has a third axis of ``num_splits`` programs per tile, each
  covering ``split_len`` context positions and writing an unnormalised partial ``(acc, m, l)``; a reduce
  kernel merges the partials. With ``num_splits == 1`` the attention kernel normalises and writes ``out``
  itself. The split count is chosen from tensor shapes only (no host sync), see ``choose_num_splits``.

Every row ``(token, head)`` of ``out`` is written exactly once; nothing else in ``out`` exists to be written.
Cache positions at or beyond a sequence's length are never read (masked loads), so stale or NaN contents of
partially-filled blocks cannot leak into the result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Heuristics (shape-only, so the launch never waits on the GPU).
_MIN_SPLIT_TOKENS = 256  # never split a context into pieces shorter than this
_MAX_SPLITS = 64
_DECODE_BLOCK_M = 16  # smallest M of a tensor-core dot
_PREFILL_BLOCK_M = 64
_TILE_N = 64
# Tests set this to fill the split partial buffers with NaN, proving the reduce reads only written partials.
_POISON_SCRATCH = False


def _empty(shape: tuple[int, ...], _fill: float, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=device)


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """The largest ``s`` with ``query_start_loc[s] // BLOCK_Q + s <= tile`` (sequence owning ``tile``)."""
    lo: tl.int32 = 0
    hi = lo + num_seqs  # a tensor even if num_seqs was specialised to a constant (loop-carried types)
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_tile <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    scale,
    num_seqs,
    split_len,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_ps,
    stride_pt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    """One (tile, kv head, split): online-softmax attention of ``BLOCK_M`` query rows over a context range.

    Invariants: ``split_len`` is a multiple of ``TILE_N``; ``head_dim`` is the last, contiguous dim of query,
    out and caches; the partial buffers (when ``USE_SPLITS``) are ``[num_splits, num_tokens, num_heads(, D)]``
    fp32 and contiguous, with ``stride_ps``/``stride_pt`` the strides of ``part_m``/``part_l`` (``part_acc``'s
    are those times ``HEAD_DIM``).
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_in_seq = tile - (q_start // BLOCK_Q + seq)
    if tile_in_seq * BLOCK_Q >= q_len:
        return  # surplus program of the upper-bound grid

    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # context position of this sequence's first new token

    rows = tl.arange(0, BLOCK_M)
    tok = tile_in_seq * BLOCK_Q + rows // GROUP_PAD  # new-token index within the sequence
    head_in_group = rows % GROUP_PAD
    head = kv_head * GROUP + head_in_group
    row_ok = (tok < q_len) & (head_in_group < GROUP)
    q_pos = first_pos + tok
    token = (q_start + tok).to(tl.int64)

    dims = tl.arange(0, HEAD_PAD)
    if HEAD_PAD == HEAD_DIM:  # noqa: SIM108  (all-true splat: loads along head_dim stay vectorised)
        dim_ok = tl.full([HEAD_PAD], 1, tl.int1)
    else:
        dim_ok = dims < HEAD_DIM

    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q = q.to(k_cache_ptr.dtype.element_ty)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Context this tile needs: up to (and including) the position of its last new token.
    last_tok = tl.minimum(tile_in_seq * BLOCK_Q + BLOCK_Q, q_len)
    kv_end = first_pos + last_tok
    kv_lo = split * split_len
    kv_hi = tl.minimum(kv_lo + split_len, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)

    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(kv_lo, kv_hi, TILE_N):
        pos = n0 + tl.arange(0, TILE_N)
        pos_ok = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        in_block = pos % BLOCK_SIZE
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        k = tl.load(
            k_cache_ptr + k_off[None, :] + dims[:, None],
            mask=pos_ok[None, :] & dim_ok[:, None],
            other=0.0,
        )  # [HEAD_PAD, TILE_N]
        v = tl.load(
            v_cache_ptr + v_off[:, None] + dims[None, :],
            mask=pos_ok[:, None] & dim_ok[None, :],
            other=0.0,
        )  # [TILE_N, HEAD_PAD]
        if UPCAST_DOT:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
        visible = (pos[None, :] <= q_pos[:, None]) & pos_ok[None, :]
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    heads_row = head.to(tl.int64)
    if USE_SPLITS:
        ml_off = split * stride_ps + token * stride_pt + heads_row
        tl.store(part_m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(part_l_ptr + ml_off, l_i, mask=row_ok)
        tl.store(
            part_acc_ptr + ml_off[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:
        result = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + heads_row[:, None] * stride_oh + dims[None, :],
            result.to(out_ptr.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    part_acc_ptr,
    part_m_ptr,
    part_l_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_ps,
    stride_pt,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """Merge the ``num_splits`` partials of one (token, head).

    ``out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s`` with ``M = max_s m_s``. Split 0 always covers
    position 0, which every query sees, so ``M`` is finite and the sum of ``l`` positive; splits that saw
    nothing carry ``m = -inf, l = 0, acc = 0`` and get weight 0.
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    splits = tl.arange(0, SPLITS_PAD)
    split_ok = splits < num_splits
    dims = tl.arange(0, HEAD_PAD)
    if HEAD_PAD == HEAD_DIM:  # noqa: SIM108  (all-true splat: loads along head_dim stay vectorised)
        dim_ok = tl.full([HEAD_PAD], 1, tl.int1)
    else:
        dim_ok = dims < HEAD_DIM

    ml_off = splits * stride_ps + token * stride_pt + head
    m = tl.load(part_m_ptr + ml_off, mask=split_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + ml_off, mask=split_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp(m - m_safe)
    total = tl.sum(w * l_s, 0)
    acc = tl.load(
        part_acc_ptr + ml_off[:, None] * HEAD_DIM + dims[None, :],
        mask=split_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    result = tl.sum(acc * w[:, None], 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        result.to(out_ptr.dtype.element_ty),
        mask=dim_ok,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # interpreter: keep the auto-chosen grids small


def choose_num_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """How many context splits per tile, from shapes only.

    No split once the grid already has ``>= 2`` programs per SM (typical for large decode batches and for any
    real prefill). Otherwise split until there are about ``8`` programs per SM, rounded down to a power of two
    (whole waves; on an H200, 8 sequences x 8 KV heads x 32K context ran in 0.307 ms at 16 splits against
    0.346 ms at the 9 that ~4 per SM gave), but never into pieces shorter than ``_MIN_SPLIT_TOKENS`` context
    positions and never more than ``_MAX_SPLITS``. ``max_context`` is the block-table capacity
    (``max_blocks * block_size``), an upper bound of every sequence's length.
    """
    if num_programs >= 2 * num_sms:
        return 1
    wanted = _cdiv(8 * num_sms, max(1, num_programs))
    wanted = 1 << (wanted.bit_length() - 1)
    return max(1, min(wanted, _cdiv(max_context, _MIN_SPLIT_TOKENS), _MAX_SPLITS))


@dataclass(frozen=True)
class LaunchPlan:
    """How ``paged_attention`` cuts one call into programs (derived from shapes only)."""

    block_m: int  # query rows per program: block_q tokens x group_pad heads
    block_q: int
    group_pad: int
    head_pad: int
    tile_n: int  # context positions per inner iteration
    num_tiles: int  # grid axis 0 (an upper bound; surplus programs exit at once)
    num_splits: int  # grid axis 2; > 1 means partials + a reduce kernel
    split_len: int  # context positions per split, a multiple of tile_n
    num_warps: int
    num_stages: int


def launch_plan(
    num_tokens: int,
    num_seqs: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_context: int,
    device: torch.device,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
) -> LaunchPlan:
    """The launch configuration for a call with these shapes; ``max_context = max_blocks * block_size``.

    A pure decode batch (``num_tokens == num_seqs``) uses the smallest tensor-core M (16 rows); anything with
    prefill uses 64-row tiles. See ``choose_num_splits`` for the split-context factor.
    """
    group_pad = _next_pow2(num_heads // num_kv_heads)
    decode_only = num_tokens == num_seqs
    block_m = max(_DECODE_BLOCK_M if decode_only else _PREFILL_BLOCK_M, group_pad)
    block_q = block_m // group_pad
    tile_n = tile_n or _TILE_N
    num_tiles = num_tokens // block_q + num_seqs
    if num_splits is None:
        real_tiles = num_seqs if decode_only else num_tiles
        num_splits = choose_num_splits(real_tiles * num_kv_heads, max_context, _num_sms(device))
    num_splits = max(1, int(num_splits))
    split_len = _cdiv(_cdiv(max_context, num_splits), tile_n) * tile_n
    return LaunchPlan(
        block_m=block_m,
        block_q=block_q,
        group_pad=group_pad,
        head_pad=_next_pow2(head_dim),
        tile_n=tile_n,
        num_tiles=num_tiles,
        num_splits=max(1, _cdiv(max_context, split_len)),
        split_len=split_len,
        num_warps=4,
        num_stages=3 if decode_only else 2,
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    tile_n: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged context; see the module docstring.

    ``num_splits`` forces the split-context factor (``None``: ``choose_num_splits``); ``tile_n`` overrides the
    number of context positions per inner iteration (a power of two >= 16). Both exist for tests and tuning.
    ``out`` (same shape as ``query``, contiguous ``head_dim``) receives the result instead of a new tensor.
    Launches no host synchronisation: all launch parameters derive from tensor shapes.
    """
    if query.dim() != 3 or key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError("query must be [tokens, heads, dim] and caches [blocks, kv_heads, block_size, dim]")
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, cache_dim = key_cache.shape
    if cache_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"bad shapes: query {tuple(query.shape)}, cache {tuple(key_cache.shape)}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("cache head_dim must be contiguous")
    device = query.device
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.stride(-1) != 1:
        raise ValueError("out must have the query's shape and a contiguous head_dim")
    num_seqs = block_tables.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    if out.stride(-1) != 1:  # empty_like of a strided query
        out = torch.empty(query.shape, dtype=query.dtype, device=device)
    block_tables = block_tables.to(device)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    seq_lens = seq_lens.to(device).contiguous()
    query_start_loc = query_start_loc.to(device).contiguous()

    plan = launch_plan(
        num_tokens,
        num_seqs,
        num_heads,
        num_kv_heads,
        head_dim,
        block_tables.shape[1] * block_size,
        device,
        num_splits=num_splits,
        tile_n=tile_n,
    )
    num_splits, use_splits = plan.num_splits, plan.num_splits > 1

    if use_splits:
        scratch = torch.full if _POISON_SCRATCH else _empty
        shape = (num_splits, num_tokens, num_heads)
        part_m = scratch(shape, float("nan"), dtype=torch.float32, device=device)
        part_l = scratch(shape, float("nan"), dtype=torch.float32, device=device)
        part_acc = scratch(
            (num_splits, num_tokens, num_heads, head_dim), float("nan"), dtype=torch.float32, device=device
        )
    else:
        part_m = part_l = part_acc = out  # unused

    interpreting = _interpreting()
    fp32 = key_cache.dtype == torch.float32
    # The interpreter mis-multiplies bf16 dots (triton 3.x); upcast there only. fp32 uses exact IEEE dots.
    upcast = interpreting and key_cache.dtype == torch.bfloat16
    precision = "ieee" if (fp32 or upcast) else "tf32"
    launch = {} if interpreting else {"num_warps": plan.num_warps, "num_stages": plan.num_stages}

    _paged_attention_kernel[(plan.num_tiles, num_kv_heads, num_splits)](
        out,
        part_acc,
        part_m,
        part_l,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        float(scale),
        num_seqs,
        plan.split_len,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(2),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(2),
        value_cache.stride(1),
        block_tables.stride(0),
        part_m.stride(0) if use_splits else 0,
        part_m.stride(1) if use_splits else 0,
        GROUP=num_heads // num_kv_heads,
        GROUP_PAD=plan.group_pad,
        HEAD_DIM=head_dim,
        HEAD_PAD=plan.head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=plan.block_q,
        BLOCK_M=plan.block_m,
        TILE_N=plan.tile_n,
        USE_SPLITS=use_splits,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        **launch,
    )
    if use_splits:
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out,
            part_acc,
            part_m,
            part_l,
            num_splits,
            out.stride(0),
            out.stride(1),
            part_m.stride(0),
            part_m.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=plan.head_pad,
            SPLITS_PAD=_next_pow2(num_splits),
            **({} if interpreting else {"num_warps": 4}),
        )
    return out
