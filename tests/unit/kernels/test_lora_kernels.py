"""The batched LoRA delta (``kernels.lora``): the grouping of a step's rows by adapter slot, and the torch
``lora_add`` against a row-by-row reference (the Triton form is checked against it in test_triton_kernels.py)."""

from __future__ import annotations

import pytest
import torch

import pagewise.kernels as kernels
from pagewise.kernels import cpu_ops
from pagewise.kernels.lora import LoraBatch


def row_by_row(y, x, lora_a, lora_b, row_slots, scalings):
    """The oracle: every row on its own, in float64."""
    out = y.double().clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            a, b = lora_a[slot].double(), lora_b[slot].double()
            out[row] += scalings[slot] * (b.t() @ (a @ x[row].double()))
    return out


def random_stacks(num_slots, rank, d_in, d_out, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    lora_a = torch.randn(num_slots, rank, d_in, generator=gen).to(dtype)
    lora_b = torch.randn(num_slots, rank, d_out, generator=gen).to(dtype)
    return lora_a, lora_b


def test_build_groups_rows_by_slot_and_leaves_base_rows_out() -> None:
    batch = LoraBatch.build([2, -1, 0, 2, -1, 0, 0], [0.5, 1.0, 2.0], torch.device("cpu"))
    assert batch.order.tolist() == [2, 5, 6, 0, 3]
    assert batch.segments == ((0, 0, 3, 0.5), (2, 3, 5, 2.0))
    assert batch.segment_starts.tolist() == [0, 3, 5] and batch.segment_slots.tolist() == [0, 2]
    assert batch.offset is None
    assert LoraBatch.build([-1, -1], [], torch.device("cpu")) is None


def test_contiguous_rows_are_sliced_not_gathered() -> None:
    batch = LoraBatch.build([-1, 1, 1, 1, -1], [1.0, 3.0], torch.device("cpu"))
    assert batch.offset == 1 and batch.segments == ((1, 0, 3, 3.0),)
    # rows 1 and 3 of one slot with a base row between them are not contiguous
    assert LoraBatch.build([1, -1, 1], [1.0, 1.0], torch.device("cpu")).offset is None


def test_restrict_renumbers_a_range_of_rows() -> None:
    batch = LoraBatch.build([0, 1, -1, 1, 0, 1], [1.0, 2.0], torch.device("cpu"))
    part = batch.restrict(2, 5)
    assert part.row_slots == (-1, 1, 0) and part.order.tolist() == [2, 1]
    assert batch.restrict(2, 5) is part  # memoized
    assert batch.restrict(2, 3) is None


PARTS = (24, 16, 40)  # a fused projection's parts (q, k, v): each owns PART_RANK rank rows and its own columns
PART_RANK = 7  # 21 rank rows in all: blocks of four and a remainder


def block_diagonal_stacks(num_slots: int, d_in: int, seed: int):
    """Float32 slot stacks as the engine lays them out: ``lora_b`` zero outside each part's block."""
    rank = PART_RANK * len(PARTS)
    lora_a, lora_b = random_stacks(num_slots, rank, d_in, sum(PARTS), torch.float32, seed)
    bounds = [0]
    for part, size in enumerate(PARTS):
        bounds.append(bounds[-1] + size)
        rows = slice(part * PART_RANK, (part + 1) * PART_RANK)
        lora_b[:, rows, : bounds[-2]] = 0
        lora_b[:, rows, bounds[-1] :] = 0
    return lora_a, lora_b, torch.tensor(bounds)


@pytest.mark.parametrize(
    "row_slots",
    [
        [0, 1, 2, 3, 0, 1, 2, 3],  # decode: every row another adapter
        [-1, 3, 3, 3, 3, -1, 1, 1, 0, -1],  # prefill chunks and base rows mixed
        [2] * 37,  # one adapter: contiguous, sliced
        [-1, -1, 1, 1, 1],
    ],
    ids=["interleaved", "mixed", "one-adapter", "tail"],
)
@pytest.mark.parametrize(
    ("x_dtype", "y_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float32, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16),
    ],
    ids=["fp32", "bf16-in", "bf16-out", "bf16"],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_lora_add_equals_row_by_row(row_slots, x_dtype, y_dtype, backend, monkeypatch) -> None:
    """The torch form and the compiled op against the float64 row-by-row oracle; base rows untouched."""
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("the compiled CPU kernels are not built")
    monkeypatch.setenv("PAGEWISE_KERNEL_BACKEND", backend)
    lora_a, lora_b, bounds = block_diagonal_stacks(4, 40, seed=len(row_slots))
    scalings = [0.5, 2.0, 1.0, 0.25]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(len(row_slots), 40, generator=gen).to(x_dtype)
    y = torch.randn(len(row_slots), sum(PARTS), generator=gen).to(y_dtype)
    original = y.clone()
    expected = row_by_row(y, x, lora_a, lora_b, row_slots, scalings)
    kernels.lora_add(y, x, lora_a, lora_b, LoraBatch.build(row_slots, scalings, torch.device("cpu")), bounds)
    tolerance = 1e-5 if y_dtype is torch.float32 else 1e-2  # a bf16 y is rounded once
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()
    base_rows = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(y[base_rows], original[base_rows])


@pytest.mark.parametrize("row_slots", [[0, 1, 2, 3, 0, 1, 2, 3], [-1, 3, 3, 3, 3, -1, 1, 1, 0, -1, 2]])
@pytest.mark.parametrize("d_in", [40, 64])  # 32 inputs a step: one masked tail, none
@pytest.mark.parametrize(("x_dtype", "y_dtype"), [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_lora_add_with_bf16_stacks(row_slots, d_in, x_dtype, y_dtype, backend, monkeypatch) -> None:
    """bf16 stacks (a bf16 projection's): the delta of the bf16-rounded inputs, summed in float32 by the compiled
    op; the torch form rounds its products to bf16 too."""
    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("the compiled CPU kernels are not built")
    monkeypatch.setenv("PAGEWISE_KERNEL_BACKEND", backend)
    lora_a, lora_b, bounds = block_diagonal_stacks(4, d_in, seed=d_in)
    lora_a, lora_b = lora_a.to(torch.bfloat16), lora_b.to(torch.bfloat16)
    scalings = [0.5, 2.0, 1.0, 0.25]
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(len(row_slots), d_in, generator=gen).to(x_dtype)
    y = torch.randn(len(row_slots), sum(PARTS), generator=gen).to(y_dtype)
    original = y.clone()
    expected = row_by_row(y, x.to(torch.bfloat16), lora_a, lora_b, row_slots, scalings)
    kernels.lora_add(y, x, lora_a, lora_b, LoraBatch.build(row_slots, scalings, torch.device("cpu")), bounds)
    exact_sums = backend == "cpu" and y_dtype is torch.float32
    tolerance = 1e-5 if exact_sums else 2e-2
    assert (y.double() - expected).abs().max() <= tolerance * expected.abs().max()
    base_rows = [r for r, s in enumerate(row_slots) if s < 0]
    assert torch.equal(y[base_rows], original[base_rows])
