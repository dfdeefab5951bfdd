"""Triton form of ``lora.lora_add``: Punica's SGMV as two kernels, shrink then expand.

Grid: (segment, row tile, column tile). A program reads its segment's slot, start and end, gathers its rows'
inputs through ``order`` (masked past the segment's end) and multiplies by that slot's weights:

* shrink: ``shrunk[start:end] = x[order[start:end]] @ lora_a[slot]ᵀ`` (``[n, R]``, fp32);
* expand: ``y[order[start:end]] += scaling · shrunk[start:end] @ lora_b[slot]``.

Each output element belongs to exactly one program (a row is in one segment, a column in one tile), so the
read-add-write of ``y`` needs no atomics. Products accumulate in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagewise.kernels.lora import LoraBatch

_BLOCK_M = 16
_BLOCK_N = 32
_BLOCK_K = 32


@triton.jit
def _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M: tl.constexpr):
    """This program's segment: its slot, and the positions, mask and rows of its tile of the segment's rows."""
    seg, tile_m = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(starts_ptr + seg), tl.load(starts_ptr + seg + 1)
    slot = tl.load(slots_ptr + seg).to(tl.int64)
    pos = start + tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    in_seg = pos < end
    rows = tl.load(order_ptr + pos, mask=in_seg, other=0)
    return seg, slot, pos, in_seg, rows


@triton.jit
def _shrink_kernel(
    x_ptr, order_ptr, a_ptr, out_ptr, starts_ptr, slots_ptr,
    K, N, stride_x, stride_a_slot, stride_a_row, stride_out,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    _, slot, pos, in_seg, rows = _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = (ks < K)[None, :]
        xt = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=in_seg[:, None] & in_k, other=0.0)
        at = tl.load(
            a_ptr + slot * stride_a_slot + cols[None, :] * stride_a_row + ks[:, None],
            mask=(cols < N)[None, :] & (ks < K)[:, None],
            other=0.0,
        )
        acc += tl.dot(xt.to(tl.float32), at.to(tl.float32), input_precision="ieee")
    tl.store(out_ptr + pos[:, None] * stride_out + cols[None, :], acc, mask=in_seg[:, None] & (cols < N)[None, :])


@triton.jit
def _expand_kernel(
    shrunk_ptr, order_ptr, b_ptr, y_ptr, starts_ptr, slots_ptr, scalings_ptr,
    K, N, stride_s, stride_b_slot, stride_b_rank, stride_y,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    seg, slot, pos, in_seg, rows = _segment_rows(order_ptr, starts_ptr, slots_ptr, BLOCK_M)
    scaling = tl.load(scalings_ptr + seg)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = (ks < K)[None, :]
        st = tl.load(shrunk_ptr + pos[:, None] * stride_s + ks[None, :], mask=in_seg[:, None] & in_k, other=0.0)
        bt = tl.load(
            b_ptr + slot * stride_b_slot + ks[:, None] * stride_b_rank + cols[None, :],
            mask=(cols < N)[None, :] & (ks < K)[:, None],
            other=0.0,
        )
        acc += tl.dot(st, bt.to(tl.float32), input_precision="ieee")
    mask = in_seg[:, None] & (cols < N)[None, :]
    y_tile = y_ptr + rows[:, None] * stride_y + cols[None, :]
    current = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (current.to(tl.float32) + acc * scaling).to(y_ptr.dtype.element_ty), mask=mask)


def _longest_segment(batch: LoraBatch) -> int:
    return max(end - start for _, start, end, _ in batch.segments)


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoraBatch,
    column_bounds: torch.Tensor | None = None,
) -> None:
    """See ``lora.lora_add`` (same contract; the products in fp32, the zero blocks multiplied)."""
    n, rank, out = batch.num_rows, lora_a.shape[1], lora_b.shape[2]
    x, lora_a, lora_b = x.contiguous(), lora_a.contiguous(), lora_b.contiguous()
    assert y.stride(1) == 1, "y's rows must be contiguous"
    shrunk = torch.empty((n, rank), dtype=torch.float32, device=x.device)
    row_tiles = triton.cdiv(_longest_segment(batch), _BLOCK_M)
    num_segments = len(batch.segments)
    _shrink_kernel[(num_segments, row_tiles, triton.cdiv(rank, _BLOCK_N))](
        x, batch.order, lora_a, shrunk, batch.segment_starts, batch.segment_slots,
        x.shape[1], rank, x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    _expand_kernel[(num_segments, row_tiles, triton.cdiv(out, _BLOCK_N))](
        shrunk, batch.order, lora_b, y, batch.segment_starts, batch.segment_slots, batch.segment_scalings,
        rank, out, shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
