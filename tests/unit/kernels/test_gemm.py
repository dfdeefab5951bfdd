"""The matmul paths equal the torch reference within fp32 rounding on random inputs, a plan sends each product
to the path of its rows' band, and the timing's plan never runs a band on a path that was slower than another
where it was timed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagewise.kernels import cpu_ops
from pagewise.kernels.gemm import (
    FewRowsTiming,
    GemmPath,
    GemmPlan,
    GemmTiming,
    PackedWeight,
    WeightShape,
    few_rows_product_available,
    supported_paths,
    time_few_rows,
    time_paths,
)

CPU_PATHS = supported_paths(torch.device("cpu"), torch.float32)


def test_torch_is_always_offered_and_is_the_only_path_off_cpu() -> None:
    assert CPU_PATHS[0] is GemmPath.TORCH
    assert supported_paths(torch.device("cuda"), torch.float32) == [GemmPath.TORCH]


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("rows", [1, 3, 16, 65, 513])
@pytest.mark.parametrize("with_bias", [False, True])
def test_path_equals_reference(path: GemmPath, rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 80, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    x = torch.randn(rows, 80, generator=generator)
    got = PackedWeight(GemmPlan.single(path), weight, bias)(x)
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == torch.float32 and got.shape == (rows, 96)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("path", supported_paths(torch.device("cpu"), torch.bfloat16))
def test_bf16_path_equals_reference_within_bf16_rounding(path: GemmPath) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(64, 128, generator=generator).bfloat16()
    x = torch.randn(7, 128, generator=generator).bfloat16()
    got = PackedWeight(GemmPlan.single(path), weight, None)(x)
    expected = F.linear(x.double(), weight.double())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=5e-2)


@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", supported_paths(torch.device("cpu"), torch.bfloat16))
def test_an_fp32_weight_computed_in_bf16_is_the_product_of_the_rounded_operands(path: GemmPath, with_bias: bool):
    """``compute_dtype`` bf16 on fp32 operands: the result (fp32) is the exact product of the bf16-rounded
    weight and input, to fp32 accumulation, plus the fp32 bias — bf16 rounds the operands, not the sum."""
    generator = torch.Generator().manual_seed(1)
    weight, x = torch.randn(96, 256, generator=generator), torch.randn(5, 256, generator=generator)
    bias = torch.randn(96, generator=generator) if with_bias else None
    got = PackedWeight(GemmPlan.single(path), weight, bias, torch.bfloat16)(x)
    expected = F.linear(x.bfloat16().double(), weight.bfloat16().double())
    if bias is not None:
        expected += bias.double()
    assert got.dtype == torch.float32 and got.shape == (5, 96)
    torch.testing.assert_close(got.double(), expected, rtol=1e-2, atol=2e-2)
    far_from_fp32 = (got.double() - F.linear(x.double(), weight.double())).abs().max()
    assert far_from_fp32 > 1e-4  # it did round the operands: this is not the fp32 product


TORCH, ONEDNN = GemmPath.TORCH, GemmPath.ONEDNN_PACKED


def timing(torch_s: dict[int, float], other_s: dict[int, float]) -> GemmTiming:
    return GemmTiming({TORCH: torch_s, ONEDNN: other_s}, {rows: 25 * rows for rows in torch_s})


def test_the_plan_takes_one_path_faster_everywhere_for_every_row_count() -> None:
    plan = timing({4: 1.0, 512: 10.0}, {4: 0.3, 512: 9.0}).plan()
    assert plan == GemmPlan.single(ONEDNN) and plan.describe() == "onednn-packed"


def test_the_plan_runs_each_band_on_the_path_fastest_there() -> None:
    # far faster on decode-sized steps, 20% slower on prefill chunks: oneDNN up to halfway (geometrically), torch
    # above — never a path slower than torch where they were timed
    plan = timing({4: 1.0, 64: 4.0, 512: 10.0}, {4: 0.1, 64: 2.0, 512: 12.0}).plan()
    assert plan.bands == ((181, ONEDNN), (None, TORCH))
    assert [plan.path_for(rows) for rows in (1, 64, 181, 182, 4096)] == [ONEDNN, ONEDNN, ONEDNN, TORCH, TORCH]
    assert plan.describe() == "onednn-packed up to 181 rows, torch above"
    assert timing({4: 1.0, 512: 10.0}, {4: 1.2, 512: 9.0}).plan().bands == ((45, TORCH), (None, ONEDNN))


def test_the_plan_does_not_split_on_paths_level_within_noise() -> None:
    # 2% apart at 512 rows, within NOISE: the band below's path goes on
    assert timing({4: 1.0, 512: 9.8}, {4: 0.5, 512: 10.0}).plan() == GemmPlan.single(ONEDNN)
    assert timing({4: 1.0, 512: 10.0}, {4: 1.2, 512: 11.0}).plan() == GemmPlan.single(TORCH)
    assert GemmTiming({TORCH: {4: 1.0}}, {4: 100}).plan() == GemmPlan.single(TORCH)


@pytest.mark.parametrize(
    "bands",
    [
        (),
        ((16, TORCH),),
        ((None, TORCH), (None, ONEDNN)),
        ((64, TORCH), (16, ONEDNN), (None, TORCH)),
        ((16, TORCH), (None, TORCH)),
    ],
)
def test_a_plan_without_increasing_bounds_ending_open_is_refused(bands) -> None:
    with pytest.raises(ValueError, match="bands must"):
        GemmPlan(bands)


def test_a_plan_round_trips_through_json_and_refuses_what_it_did_not_write() -> None:
    plan = GemmPlan(((16, ONEDNN), (None, TORCH)), few_rows=4)
    assert GemmPlan.from_json(plan.as_json(), 4) == plan
    with pytest.raises(ValueError):
        GemmPlan.from_json([[None, "gpu-magic"]], 0)
    with pytest.raises(TypeError):
        GemmPlan.from_json([["16", "torch"], [None, "torch"]], 0)
    with pytest.raises(ValueError, match="few_rows"):
        GemmPlan.single(TORCH, few_rows=-1)


@pytest.mark.skipif(ONEDNN not in CPU_PATHS, reason="this torch build has no oneDNN")
def test_a_packed_weight_runs_each_product_on_its_bands_path() -> None:
    generator = torch.Generator().manual_seed(3)
    weight, bias = torch.randn(96, 80, generator=generator), torch.randn(96, generator=generator)
    banded = PackedWeight(GemmPlan(((8, TORCH), (None, ONEDNN))), weight, bias)
    by_path = {path: PackedWeight(GemmPlan.single(path), weight, bias) for path in (TORCH, ONEDNN)}
    for rows in (3, 8, 9, 40):
        x = torch.randn(rows, 80, generator=generator)
        expected = by_path[TORCH if rows <= 8 else ONEDNN](x)
        assert torch.equal(banded(x), expected)


def test_time_paths_reports_every_path_and_row_count() -> None:
    shapes = [WeightShape(64, 32, 2), WeightShape(32, 64, 1, max_rows=4)]
    result = time_paths(CPU_PATHS, shapes, (1, 8), torch.float32, seconds_per_case=0.003)
    assert set(result.seconds) == set(CPU_PATHS)
    assert all(set(by_rows) == {1, 8} and min(by_rows.values()) > 0 for by_rows in result.seconds.values())
    # the second shape runs on at most 4 rows
    assert result.flops == {1: 2 * (64 * 32 * 2 + 32 * 64), 8: 2 * (8 * 64 * 32 * 2 + 4 * 32 * 64)}
    assert result.plan().paths <= set(CPU_PATHS) and result.gflops(GemmPath.TORCH) > 0


FEW_ROWS_DTYPES = [
    pytest.param(
        dtype,
        marks=pytest.mark.skipif(
            not few_rows_product_available(dtype), reason=f"needs the compiled kernels and this CPU's {dtype} loop"
        ),
    )
    for dtype in (torch.float32, torch.bfloat16)
]


@pytest.mark.parametrize("dtype", FEW_ROWS_DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 8, 13, 17, 64, 70])  # AMX: one tile of rows, several, past four
@pytest.mark.parametrize(("d_in", "d_out"), [(576, 960), (41, 70)])  # (41, 70): a masked step, a partial block
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_few_rows_product_sums_exact_products_in_fp32(dtype, rows, d_in, d_out, out_dtype, with_bias) -> None:
    generator = torch.Generator().manual_seed(rows * d_in)
    weight = torch.randn(d_out, d_in, generator=generator).to(dtype)
    x = torch.randn(rows, d_in, generator=generator)  # rounded to the weight's dtype by the op
    bias = torch.randn(d_out, generator=generator) if with_bias else None
    got = cpu_ops.linear_few_rows(x, weight, bias, out_dtype)
    expected = F.linear(x.to(dtype).double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == out_dtype and got.shape == (rows, d_out)
    scale = expected.abs().max().item()
    tolerance = 1e-6 * scale if out_dtype is torch.float32 else 2**-8 * scale  # fp32 sums; one bf16 rounding
    assert (got.double() - expected).abs().max().item() <= tolerance


def test_the_few_rows_product_refuses_what_it_does_not_take() -> None:
    if not cpu_ops.available():
        pytest.skip("needs the compiled kernels")
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="float32 or bf16 \\[out, in\\] weight"):
        cpu_ops.linear_few_rows(x, torch.randn(4, 8).half(), None, torch.float32)
    with pytest.raises(RuntimeError, match="\\[rows, in\\] input"):
        cpu_ops.linear_few_rows(torch.randn(2, 9), torch.randn(4, 8), None, torch.float32)
    with pytest.raises(RuntimeError, match="bias is \\[out\\]"):
        cpu_ops.linear_few_rows(x, torch.randn(4, 8), torch.randn(5), torch.float32)


@pytest.mark.parametrize("path", CPU_PATHS)
@pytest.mark.parametrize("dtype", FEW_ROWS_DTYPES)
def test_a_packed_weight_takes_the_few_rows_product_up_to_its_row_limit(path, dtype) -> None:
    generator = torch.Generator().manual_seed(2)
    weight, bias = torch.randn(130, 96, generator=generator), torch.randn(130, generator=generator)
    packed = PackedWeight(GemmPlan.single(path, few_rows=5), weight, bias, dtype)
    plain = PackedWeight(GemmPlan.single(path), weight, bias, dtype)
    for rows in (1, 5, 6):
        x = torch.randn(rows, 96, generator=generator)
        few = cpu_ops.linear_few_rows(x, packed.weight, bias, torch.float32)
        assert torch.equal(packed(x), few) == (rows <= 5)
        assert torch.equal(packed(x), plain(x)) == (rows > 5)
        torch.testing.assert_close(packed(x), few, rtol=2e-2, atol=5e-2)  # a bf16 path may round its sums


def test_a_few_rows_limit_where_the_product_does_not_run_is_refused() -> None:
    missing = [dtype for dtype in (torch.float16, torch.bfloat16) if not few_rows_product_available(dtype)]
    with pytest.raises(ValueError, match="does not run here"):
        PackedWeight(GemmPlan.single(GemmPath.TORCH, few_rows=4), torch.randn(4, 8), None, missing[0])


def few_rows_timing(path_s: dict[int, float], few_s: dict[int, float]) -> FewRowsTiming:
    return FewRowsTiming(path_s, few_s, {rows: 1000 * rows for rows in path_s})


def test_the_few_rows_limit_is_the_last_row_count_before_the_product_stops_winning_clearly() -> None:
    assert few_rows_timing({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, {1: 0.7, 2: 0.8, 4: 0.9, 8: 1.2}).limit() == 4
    # faster again at 8 after losing at 4: the limit stays below the first loss
    assert few_rows_timing({1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, {1: 0.7, 2: 0.8, 4: 1.1, 8: 0.9}).limit() == 2
    assert few_rows_timing({1: 1.0, 2: 1.0}, {1: 0.98, 2: 0.5}).limit() == 0  # within noise is no win
    assert few_rows_timing({1: 1.0, 2: 1.0}, {1: 0.5, 2: 0.5}).limit() == 2
    assert few_rows_timing({1: 2.0}, {1: 1.0}).gflops() == {1: {"path": 5e-7, "few-rows": 1e-6}}


@pytest.mark.parametrize("dtype", FEW_ROWS_DTYPES)
def test_time_few_rows_times_both_at_every_row_count(dtype) -> None:
    shapes = [WeightShape(64, 32, 3), WeightShape(96, 32, 1, max_rows=2)]
    result = time_few_rows(CPU_PATHS[-1], shapes, (1, 4), dtype, rounds=1)
    assert set(result.path) == set(result.few_rows) == {1, 4}
    assert min(result.path.values()) > 0 and min(result.few_rows.values()) > 0
    assert result.flops == {1: 2 * (64 * 32 * 3 + 96 * 32), 4: 2 * (4 * 64 * 32 * 3 + 2 * 96 * 32)}
    assert result.limit() in (0, 1, 4)
