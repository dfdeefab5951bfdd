"""Dense projections ``y = x Wᵀ + b`` through one of the matmul paths this torch build has, and a timer that
says which one is fastest on this machine for a given set of weight shapes.

The paths compute the same product; they differ in the library and in the weight's memory layout:

- ``torch``: ``torch.nn.functional.linear`` — MKL's sgemm on x86 CPU builds, cuBLAS on CUDA. The reference,
  and the only path for CUDA tensors.
- ``onednn-packed``: oneDNN's inner product with the weight reordered once into oneDNN's blocked layout (the
  path vLLM's CPU build takes). On AMD EPYC this is several times faster than MKL for a handful of rows.

A product of only a few rows (a decode step at low load) can go instead to the compiled ``linear_few_rows``
(``PackedWeight``'s ``few_rows``): at a handful of rows the product is the time to stream the weights, and the
libraries' kernels, blocked for many rows, stream them at two thirds to three quarters of the rate a plain pass
reaches (docs/benchmarks.md). It reads the dense weight the path keeps anyway: bf16 on an AVX512-BF16 CPU (on AMX
tiles where the CPU has them), float32 on any with AVX2 and FMA. How many rows it pays for differs between CPUs;
``time_few_rows`` measures it on a model's own weights, streamed from memory as a step streams them.

Which path is fastest can change with the number of rows (on an AMX Xeon oneDNN's packed product is twice
MKL's at 4 and 64 rows and level with it at 512): a ``GemmPlan`` names a path per band of row counts, each
band's the fastest measured there (``GemmTiming.plan``), and ``PackedWeight`` follows it product by product.

All accumulate in fp32 and agree within rounding (the tests hold each path to the torch reference on random
inputs). Either can run an fp32 model's projections in bf16 (``PackedWeight``'s ``compute_dtype``): the
engine's ``dtype=auto`` does so where the CPU multiplies bf16 natively (``cpu_has_native_bf16``). MKL's packed
sgemm is not offered: torch packs it for one row count and falls back to the plain call for any other, and a
step's row count changes every step. A path this build or this CPU cannot run for a dtype is not offered
(``supported_paths`` tries each on a tiny product).
"""

from __future__ import annotations

import functools
import itertools
import math
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import torch
import torch.nn.functional as F

from pagewise.kernels import cpu_ops

NOISE = 0.03


class GemmPath(StrEnum):
    TORCH = "torch"
    ONEDNN_PACKED = "onednn-packed"


@dataclass(frozen=True, slots=True)
class GemmPlan:
    """Which product a projection of a given number of rows runs: at most ``few_rows`` rows (0: none) the
    compiled few-rows product, otherwise the path of the first band of ``bands`` whose bound is at least the
    row count. ``bands`` is ``((bound, path), …)`` with bounds increasing and the last one ``None`` (every larger
    product); adjacent bands have different paths."""

    bands: tuple[tuple[int | None, GemmPath], ...]
    few_rows: int = 0

    def __post_init__(self) -> None:
        bounds = [bound for bound, _ in self.bands]
        if not bounds or bounds[-1] is not None or None in bounds[:-1] or bounds[:-1] != sorted(set(bounds[:-1])):
            raise ValueError(f"bands must have increasing bounds and end with None: {self.bands}")
        if any(below[1] is above[1] for below, above in itertools.pairwise(self.bands)):
            raise ValueError(f"bands must change path from one to the next: {self.bands}")
        if self.few_rows < 0:
            raise ValueError(f"few_rows must be >= 0, not {self.few_rows}")

    @classmethod
    def single(cls, path: GemmPath, few_rows: int = 0) -> GemmPlan:
        return cls(((None, path),), few_rows)

    @property
    def paths(self) -> frozenset[GemmPath]:
        return frozenset(path for _, path in self.bands)

    def path_for(self, rows: int) -> GemmPath:
        for bound, path in self.bands:  # a plain loop: this runs for every product of a step
            if bound is None or rows <= bound:
                return path
        raise AssertionError("the last band has no bound")

    def describe(self) -> str:
        """The path's name for a one-band plan; else e.g. ``onednn-packed up to 181 rows, torch above``."""
        parts = [f"{path.value} up to {bound} rows" for bound, path in self.bands[:-1]]
        return ", ".join([*parts, f"{self.bands[-1][1].value} above"]) if parts else self.bands[0][1].value

    def as_json(self) -> list[list[object]]:
        return [[bound, path.value] for bound, path in self.bands]

    @classmethod
    def from_json(cls, bands: list[list[object]], few_rows: int) -> GemmPlan:
        """The inverse of ``as_json``; raises ``ValueError`` or ``TypeError`` for anything it did not write."""
        parsed = []
        for bound, path in bands:
            if bound is not None and type(bound) is not int:
                raise TypeError(f"a band's bound is an int or None, not {bound!r}")
            parsed.append((bound, GemmPath(path)))
        return cls(tuple(parsed), few_rows)


class PackedWeight:
    """A weight (``[out, in]``) and bias prepared once for the paths of ``plan``; calling it computes
    ``x Wᵀ + b`` for a 2-D ``x`` of the weight's or the compute dtype on the product the plan names for ``x``'s
    row count. With a ``compute_dtype`` other than the weight's (bf16 for an fp32 model), the weight is held in
    ``compute_dtype``, ``x`` is rounded to it on entry (unless it comes in it) and the product accumulates in
    fp32. The result comes back in ``out_dtype`` (default: ``x``'s), the bias added in that dtype: a bf16 result
    can go straight into the next bf16 product or into the fp32 residual stream, which saves a conversion pass
    each way. The dense ``weight`` (in ``compute_dtype``) serves the ``torch`` path and the few-rows product, the
    reordered one the ``onednn-packed`` path; the module's parameter stays what the model's state and shapes are
    read from, so a packed or converted weight is held twice."""

    __slots__ = ("plan", "weight", "bias", "compute_dtype", "_packed")

    def __init__(
        self, plan: GemmPlan, weight: torch.Tensor, bias: torch.Tensor | None, compute_dtype: torch.dtype | None = None
    ) -> None:
        """The plan's few-rows product must run here for ``compute_dtype`` (``few_rows_product_available``)."""
        self.plan, self.bias = plan, bias
        self.compute_dtype = compute_dtype or weight.dtype
        if plan.few_rows and not (weight.is_cpu and few_rows_product_available(self.compute_dtype)):
            raise ValueError(f"the few-rows product does not run here for {self.compute_dtype}")
        self.weight = weight.to(self.compute_dtype).contiguous()
        packed = GemmPath.ONEDNN_PACKED in plan.paths
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight) if packed else None

    def __call__(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        out_dtype = out_dtype or x.dtype
        rows = x.shape[0]
        if rows <= self.plan.few_rows and out_dtype in FEW_ROWS_DTYPES:
            return cpu_ops.linear_few_rows(x, self.weight, self.bias, out_dtype)
        path = self.plan.path_for(rows)
        if x.dtype == self.compute_dtype == out_dtype and (self.bias is None or self.bias.dtype == out_dtype):
            return self._product(path, x, self.bias)
        y = self._product(path, x.to(self.compute_dtype), None).to(out_dtype)
        return y if self.bias is None else y.add_(self.bias)

    def _product(self, path: GemmPath, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if path is GemmPath.ONEDNN_PACKED:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        return F.linear(x, self.weight, bias)


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of bf16 dot-product instructions


def cpu_signature() -> str:
    """The CPU's model name and feature flags (``/proc/cpuinfo``), or the platform's processor string."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    wanted = ("model name", "flags")
    found = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and key not in found:
            found[key] = value.strip()
    return " | ".join(found.get(key, "") for key in wanted)


SUMMARY_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")  # what decides the matmul paths' speed here


def cpu_flags() -> list[str]:
    """The CPU's feature flags (``/proc/cpuinfo``), empty where they cannot be read."""
    return cpu_signature().partition(" | ")[2].split()


def cpu_summary() -> str:
    """The CPU's model name and which of `SUMMARY_FLAGS` it has: how a benchmark names its machine."""
    name = cpu_signature().partition(" | ")[0]
    flags = cpu_flags()
    present = [flag for flag in SUMMARY_FLAGS if flag in flags]
    return f"{name} ({', '.join(present) or 'none of ' + '/'.join(SUMMARY_FLAGS)})"


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has bf16 dot-product instructions (AVX512-BF16 or AMX-BF16), which oneDNN uses for bf16
    products; without them a bf16 product is emulated and slower than fp32."""
    flags = cpu_flags()
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


FEW_ROWS_DTYPES = (torch.float32, torch.bfloat16)  # the weights, inputs and outputs `linear_few_rows` takes
FEW_ROWS_FLAGS = {torch.float32: ("avx2", "fma"), torch.bfloat16: ("avx512_bf16",)}  # the instructions it needs


@functools.cache
def few_rows_product_available(dtype: torch.dtype) -> bool:
    """Whether ``cpu_ops.linear_few_rows`` runs here on a ``dtype`` weight: the compiled kernels are loaded and
    the CPU has the instructions its loop for that dtype uses (FMA on AVX2 for float32, ``vdpbf16ps`` for bf16)."""
    flags = cpu_flags()
    needed = FEW_ROWS_FLAGS.get(dtype)
    return needed is not None and all(flag in flags for flag in needed) and cpu_ops.available()


def supported_paths(device: torch.device, dtype: torch.dtype) -> list[GemmPath]:
    """The paths that run here for ``dtype``: ``torch`` always; the packed ones on CPU where this torch build
    has them and a tiny product through them equals the reference."""
    paths = [GemmPath.TORCH]
    if device.type != "cpu":
        return paths
    candidates = [GemmPath.ONEDNN_PACKED] if torch.backends.mkldnn.is_available() else []
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=generator).to(dtype)
    w = torch.randn(16, 32, generator=generator).to(dtype)
    expected = F.linear(x.float(), w.float())
    for path in candidates:
        try:
            got = PackedWeight(GemmPlan.single(path), w, None)(x).float()
        except RuntimeError:  # not compiled for this CPU or dtype
            continue
        if torch.allclose(got, expected, rtol=2e-2, atol=2e-2):
            paths.append(path)
    return paths


@dataclass(frozen=True, slots=True)
class WeightShape:
    """One kind of projection in a model: ``count`` weights of ``[out_features, in_features]`` per forward, each
    applied to a step's rows up to ``max_rows`` (the LM head sees only the rows sampled: one per sequence)."""

    out_features: int
    in_features: int
    count: int
    max_rows: int | None = None

    def rows(self, step_rows: int) -> int:
        return step_rows if self.max_rows is None else min(step_rows, self.max_rows)


@dataclass(frozen=True, slots=True)
class GemmTiming:
    """Seconds one forward's projections take, per path and per number of rows (tokens in a step)."""

    seconds: dict[GemmPath, dict[int, float]]
    flops: dict[int, int]  # per number of rows: the flops of one forward's projections

    def gflops(self, path: GemmPath) -> float:
        """The path's rate over every row count measured (total flops / total seconds)."""
        return sum(self.flops.values()) / sum(self.seconds[path].values()) / 1e9

    def gflops_at(self, path: GemmPath, rows: int) -> float:
        return self.flops[rows] / self.seconds[path][rows] / 1e9

    def plan(self) -> GemmPlan:
        """A band per row count timed, each with the path fastest there, bounded halfway (geometrically) to the
        next count: so no band runs slower than ``torch`` where it was timed. A band keeps the path of the band
        below when that path is within ``NOISE`` (the spread of two timings of one path) of the fastest, so
        paths level with each other do not split the plan on noise."""
        counts = sorted(self.seconds[GemmPath.TORCH])
        bands: list[tuple[int | None, GemmPath]] = []
        for i, rows in enumerate(counts):
            time_at = {path: by_rows[rows] for path, by_rows in self.seconds.items()}
            path = min(time_at, key=time_at.__getitem__)
            if bands and time_at[bands[-1][1]] <= time_at[path] * (1 + NOISE):
                path = bands[-1][1]
            bound = None if i == len(counts) - 1 else round(math.sqrt(rows * counts[i + 1]))
            if bands and bands[-1][1] is path:
                bands[-1] = (bound, path)
            else:
                bands.append((bound, path))
        return GemmPlan(tuple(bands))


def time_paths(
    paths: Sequence[GemmPath],
    shapes: Sequence[WeightShape],
    rows: Sequence[int],
    dtype: torch.dtype,
    *,
    seconds_per_case: float = 0.1,
    rounds: int = 3,
) -> GemmTiming:
    """Time every path on every shape at every row count (CPU, random data). Each case runs for about
    ``seconds_per_case / rounds`` per round after a warm-up call; the rounds interleave the paths, and the best
    round of each case is kept, so a busy moment elsewhere on the machine hits every path alike."""
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(s.out_features, s.in_features, generator=generator).to(dtype) * 0.05 for s in shapes]
    inputs = {
        m: {
            (s.rows(m), s.in_features): torch.randn(s.rows(m), s.in_features, generator=generator).to(dtype)
            for s in shapes
        }
        for m in rows
    }
    prepared = {path: [PackedWeight(GemmPlan.single(path), w, None) for w in weights] for path in paths}
    best = {(path, m, i): float("inf") for path in paths for m in rows for i in range(len(shapes))}
    with torch.inference_mode():
        for _ in range(rounds):
            for m in rows:
                for path in paths:
                    for i, (shape, op) in enumerate(zip(shapes, prepared[path], strict=True)):
                        x = inputs[m][shape.rows(m), shape.in_features]
                        best[path, m, i] = min(best[path, m, i], _time_call(op, x, seconds_per_case / rounds))
    seconds = {path: {m: sum(s.count * best[path, m, i] for i, s in enumerate(shapes)) for m in rows} for path in paths}
    flops = {m: sum(2 * s.rows(m) * s.out_features * s.in_features * s.count for s in shapes) for m in rows}
    return GemmTiming(seconds, flops)


def _time_call(op: PackedWeight, x: torch.Tensor, budget: float) -> float:
    """Seconds per call of ``op(x)``, over at least one call and about ``budget`` seconds, after a warm-up."""
    op(x)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget or calls == 0:
        op(x)
        calls += 1
    return elapsed / calls


COLD_BYTES = 128 * 2**20  # per weight shape: past any CPU cache of this kind, so a timing streams from memory


@dataclass(frozen=True, slots=True)
class FewRowsTiming:
    """Seconds one forward's projections take on a path (``path``) and through the few-rows product
    (``few_rows``), per number of rows, and the flops of that forward per number of rows."""

    path: dict[int, float]
    few_rows: dict[int, float]
    flops: dict[int, int]

    def limit(self) -> int:
        """The most rows to send to the few-rows product: the largest row count up to which it beat the path by
        more than ``NOISE`` at every count timed (0: not at the smallest)."""
        limit = 0
        for rows in sorted(self.path):
            if self.few_rows[rows] > self.path[rows] * (1 - NOISE):
                break
            limit = rows
        return limit

    def gflops(self) -> dict[int, dict[str, float]]:
        return {
            rows: {
                "path": self.flops[rows] / self.path[rows] / 1e9,
                "few-rows": self.flops[rows] / self.few_rows[rows] / 1e9,
            }
            for rows in self.path
        }


def time_few_rows(
    path: GemmPath, shapes: Sequence[WeightShape], rows: Sequence[int], dtype: torch.dtype, *, rounds: int = 3
) -> FewRowsTiming:
    """Time one forward's projections on ``path`` and through ``cpu_ops.linear_few_rows`` at each row count.
    Unlike ``time_paths``, which times one weight of each shape over and over (held in cache), each shape gets
    its forward's own count of distinct weights, up to ``COLD_BYTES`` of them: a step reads every layer's weights
    once, from memory, and at a few rows that read is the whole cost. The rounds interleave the two and the best
    of each is kept. The product must run here for ``dtype`` (``few_rows_product_available``)."""
    generator = torch.Generator().manual_seed(0)
    element_size = torch.empty((), dtype=dtype).element_size()
    groups = []
    for shape in shapes:
        copies = max(1, min(shape.count, COLD_BYTES // (shape.out_features * shape.in_features * element_size)))
        weights = [
            torch.empty(shape.out_features, shape.in_features, dtype=dtype).uniform_(-0.05, 0.05, generator=generator)
            for _ in range(copies)
        ]
        groups.append((shape, [PackedWeight(GemmPlan.single(path), w, None) for w in weights]))
    inputs = {
        (m, shape): torch.randn(shape.rows(m), shape.in_features, generator=generator).to(dtype)
        for m in rows
        for shape in shapes
    }

    def forward_seconds(m: int, few: bool) -> float:
        total = 0.0
        for shape, ops in groups:
            x = inputs[m, shape]
            start = time.perf_counter()
            for op in ops:
                if few:
                    cpu_ops.linear_few_rows(x, op.weight, None, dtype)
                else:
                    op(x)
            total += (time.perf_counter() - start) * shape.count / len(ops)
        return total

    best = {(m, few): float("inf") for m in rows for few in (False, True)}
    with torch.inference_mode():
        for m, few in best:  # warm-up: first calls allocate
            forward_seconds(m, few)
        for _ in range(rounds):
            for m, few in best:
                best[m, few] = min(best[m, few], forward_seconds(m, few))
    flops = {m: sum(2 * s.rows(m) * s.out_features * s.in_features * s.count for s in shapes) for m in rows}
    return FewRowsTiming({m: best[m, False] for m in rows}, {m: best[m, True] for m in rows}, flops)
