"""Batched LoRA deltas for one step: many adapters and the base model in one batch (Punica's segmented gather
matmul, SGMV).

A projection targeted by adapters holds a stack of every adapter slot's weights in its compute dtype (float32,
or bf16 for a bf16 projection: the products then take bf16 inputs and accumulate in float32): ``lora_a``
``[slots, R, in]`` (PEFT's ``A`` rows) and ``lora_b`` ``[slots, R, out]`` (PEFT's ``B`` transposed), ``R`` = the
projection's parts × the engine's max rank. A fused projection's parts sit block-diagonally in ``lora_b``: part
``p`` owns rank rows ``p·R/parts …`` and only its own columns (``column_bounds[p] … column_bounds[p+1]``); lower
ranks are zero-padded, which adds exact zeros. A step's ``LoraBatch`` groups the rows that run under an adapter
by slot, once per step; each projection then adds, for each group (segment), ``scaling · (x[rows] @ Aᵀ) @ B`` to
its output rows — never a loop over rows. Base-model rows are left out entirely.

``lora_add`` here is the torch form (the kernels' oracle, and the CPU path where the compiled kernels are not
built): one gather, two products per adapter present in the step and one scatter. The compiled CPU op
(``cpu_ops``) and the Triton kernels (``triton_lora``) do the same in one call per projection.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoraBatch:
    """Which adapter slot each row of a step's activations uses, grouped for segment-wise products.

    Invariants: ``order`` lists the rows that use an adapter, grouped by slot in ascending slot order and in row
    order within a slot; ``segments[i] = (slot, start, end, scaling)`` covers ``order[start:end]``, consecutive
    and non-overlapping, ``end - start >= 1``. ``offset`` is not None exactly when ``order`` is the contiguous
    range ``offset, offset + 1, …`` (then rows are sliced, not gathered). ``row_slots`` (-1: the base model)
    and each slot's scaling are kept to cut the batch down to a range of rows (``restrict``).
    """

    row_slots: tuple[int, ...]
    scalings: tuple[float, ...]  # by slot
    order: torch.Tensor  # [n] int64, on the activations' device
    offset: int | None
    segments: tuple[tuple[int, int, int, float], ...]
    segment_starts: torch.Tensor  # [len(segments) + 1] int32: the starts, then n
    segment_slots: torch.Tensor  # [len(segments)] int32
    segment_scalings: torch.Tensor  # [len(segments)] float32
    _parts: dict[tuple[int, int], LoraBatch | None] = field(default_factory=dict)

    @classmethod
    def build(
        cls, row_slots: Sequence[int], scalings: Sequence[float], device: torch.device
    ) -> LoraBatch | None:
        """The batch of rows whose slot is ``row_slots[i]`` (-1: base model; ``scalings[slot]`` is the slot's
        adapter scaling), or None when no row uses an adapter."""
        rows = sorted((i for i, slot in enumerate(row_slots) if slot >= 0), key=row_slots.__getitem__)
        if not rows:
            return None
        segments, start = [], 0
        for end in range(1, len(rows) + 1):
            if end == len(rows) or row_slots[rows[end]] != row_slots[rows[start]]:
                slot = row_slots[rows[start]]
                segments.append((slot, start, end, float(scalings[slot])))
                start = end
        contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
        return cls(
            tuple(row_slots),
            tuple(scalings),
            torch.tensor(rows, dtype=torch.int64, device=device),
            rows[0] if contiguous else None,
            tuple(segments),
            torch.tensor([s[1] for s in segments] + [len(rows)], dtype=torch.int32, device=device),
            torch.tensor([s[0] for s in segments], dtype=torch.int32, device=device),
            torch.tensor([s[3] for s in segments], dtype=torch.float32, device=device),
        )

    @property
    def num_rows(self) -> int:
        return self.order.shape[0]

    def restrict(self, start: int, end: int) -> LoraBatch | None:
        """The batch of rows ``[start, end)`` alone, numbered from 0 (memoized: a step's MLP parts cover the
        same ranges in every layer)."""
        key = (start, end)
        if key not in self._parts:
            self._parts[key] = LoraBatch.build(self.row_slots[start:end], self.scalings, self.order.device)
        return self._parts[key]


def lora_add(
    y: torch.Tensor,
    x: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    batch: LoraBatch,
    column_bounds: torch.Tensor | None = None,
) -> None:
    """``y[r] += scaling · (x[r] @ lora_a[slot]ᵀ) @ lora_b[slot]`` for every row ``r`` of ``batch`` (in place; the
    products in the stacks' dtype, the sum in ``y``'s). ``column_bounds`` (which columns each part owns) lets a
    kernel skip the zero blocks; this form multiplies them."""
    n = batch.num_rows
    xs = x[batch.offset : batch.offset + n] if batch.offset is not None else x.index_select(0, batch.order)
    xs = xs.to(lora_a.dtype)
    shrunk = torch.empty((n, lora_a.shape[1]), dtype=lora_a.dtype, device=x.device)
    delta = torch.empty((n, lora_b.shape[2]), dtype=lora_a.dtype, device=x.device)
    for slot, start, end, scaling in batch.segments:
        torch.mm(xs[start:end], lora_a[slot].t(), out=shrunk[start:end])
        torch.addmm(delta[start:end], shrunk[start:end], lora_b[slot], beta=0, alpha=scaling, out=delta[start:end])
    if batch.offset is not None:
        y[batch.offset : batch.offset + n] += delta
    else:
        y.index_add_(0, batch.order, delta.to(y.dtype))
