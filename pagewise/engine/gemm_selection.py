"""Which matmul path (``pagewise.kernels.gemm``) an engine's projections run on, chosen at start-up.

``EngineConfig.gemm_path`` is ``auto`` (the default) or a path's name. ``auto`` on CUDA is ``torch``. On CPU it
times every path this machine supports on the model's own weight shapes, at a decode-sized, a mid-sized and a
prefill-chunk-sized step, and runs each band of row counts on the path fastest there (``GemmTiming.plan``: one
path for every step where one is fastest throughout). The timing is stored under ``<cache root>/gemm/`` keyed
by everything that decides it — the CPU's model name and flags, torch's version, the number of threads, the
dtype and the shapes — so it runs once per machine kind and model (about a second for SmolLM2), and a machine
of another kind measures anew. A named path is used as given, after checking that this machine runs it.

With the bands chosen, ``auto`` also measures how many rows of a step the compiled few-rows product
(``cpu_ops.linear_few_rows``) beats the smallest rows' path for, where that product runs for the dtype
(``few_rows``: 0 where it does not, or where it is slower even for one row): the model's weights streamed from
memory as in a step (``time_few_rows``), at 1 to 64 rows. That limit depends on the CPU's memory system and the
library's kernels as much as on the instructions, so it is measured, not assumed. A named path runs every
product on that path (the off switch for comparisons).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from pagewise.engine.errors import InvalidConfigError
from pagewise.engine.model_config import ModelArchConfig
from pagewise.kernels.gemm import (
    FewRowsTiming,
    GemmPath,
    GemmPlan,
    WeightShape,
    cpu_signature,
    few_rows_product_available,
    supported_paths,
    time_few_rows,
    time_paths,
)

AUTO = "auto"
CHOICES = (AUTO, *(path.value for path in GemmPath))
TIMED_ROWS = (4, 64, 512)  # tokens in a step: a few decodes, a full decode batch, a prefill chunk
FEW_ROWS_TIMED = (1, 2, 4, 8, 16, 32, 64)  # the row counts the few-rows product is timed at
LM_HEAD_ROWS = 64  # the LM head runs on one row per sequence: a 512-token prefill chunk samples a few

_logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GemmSelection:
    """The plan chosen (paths by row count, and the few-rows product's limit) and why: ``source`` is ``forced``
    (a path named in the config), ``measured`` (timed now), ``cached`` (timed earlier on this kind of machine)
    or ``device`` (CUDA: torch). ``gflops`` holds each candidate path's rate over every row count when it was
    timed."""

    plan: GemmPlan
    source: str
    gflops: dict[str, float]


def weight_shapes(arch: ModelArchConfig) -> list[WeightShape]:
    """The projections of one forward: fused qkv, o, fused gate/up and down per layer, plus the LM head (on at
    most ``LM_HEAD_ROWS`` rows)."""
    hidden, layers = arch.hidden_size, arch.num_layers
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    return [
        WeightShape(q_size + 2 * kv_size, hidden, layers),
        WeightShape(hidden, q_size, layers),
        WeightShape(2 * arch.intermediate_size, hidden, layers),
        WeightShape(hidden, arch.intermediate_size, layers),
        WeightShape(arch.vocab_size, hidden, 1, max_rows=LM_HEAD_ROWS),
    ]


def select_gemm_path(
    requested: str, arch: ModelArchConfig, device: torch.device, dtype: torch.dtype, cache_root: Path
) -> GemmSelection:
    """The path for this engine (see the module docstring). Raises ``InvalidConfigError`` for a named path
    this machine cannot run for ``dtype``."""
    supported = supported_paths(device, dtype)
    if requested != AUTO:
        path = GemmPath(requested)
        if path not in supported:
            names = ", ".join(p.value for p in supported)
            raise InvalidConfigError(
                f"gemm_path {requested!r} does not run on {device.type} for {dtype} here; supported: {names}"
            )
        return GemmSelection(GemmPlan.single(path), "forced", {})
    if device.type != "cpu":
        return GemmSelection(GemmPlan.single(GemmPath.TORCH), "device", {})
    shapes = weight_shapes(arch)
    entry = cache_root / "gemm" / f"{_cache_key(supported, shapes, dtype)}.json"
    cached = _read(entry)
    if cached is not None:
        return GemmSelection(cached[0], "cached", cached[1])
    timing = time_paths(supported, shapes, TIMED_ROWS, dtype)
    plan = timing.plan()
    if few_rows_product_available(dtype):
        plan = GemmPlan(plan.bands, time_few_rows_against(plan, shapes, dtype).limit())
    selection = GemmSelection(plan, "measured", {p.value: round(timing.gflops(p), 2) for p in supported})
    _write(entry, {"bands": plan.as_json(), "candidates_gflops": selection.gflops, "few_rows": plan.few_rows})
    return selection


def time_few_rows_against(plan: GemmPlan, shapes: list[WeightShape], dtype: torch.dtype) -> FewRowsTiming:
    """The few-rows product timed at ``FEW_ROWS_TIMED`` rows against the path ``plan`` runs those rows on."""
    return time_few_rows(plan.path_for(FEW_ROWS_TIMED[-1]), shapes, FEW_ROWS_TIMED, dtype)


def _cache_key(paths: list[GemmPath], shapes: list[WeightShape], dtype: torch.dtype) -> str:
    parts = [
        cpu_signature(),
        torch.__version__,
        str(torch.get_num_threads()),
        str(dtype),
        ",".join(p.value for p in paths),
        ";".join(f"{s.out_features}x{s.in_features}x{s.count}x{s.max_rows}" for s in shapes),
        ",".join(map(str, TIMED_ROWS)),
        f"few-rows {few_rows_product_available(dtype)} {','.join(map(str, FEW_ROWS_TIMED))}",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _read(entry: Path) -> tuple[GemmPlan, dict[str, float]] | None:
    """The cached plan and candidates' rates, or None for a missing entry or one this version did not write
    (an entry from before the plan had bands has a ``chosen`` path instead: measured anew)."""
    try:
        data = json.loads(entry.read_text())
        gflops = data["candidates_gflops"]
        if not isinstance(gflops, dict) or type(data["few_rows"]) is not int:
            return None
        return GemmPlan.from_json(data["bands"], data["few_rows"]), gflops
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write(entry: Path, data: dict) -> None:
    """Write under a temporary name, then rename: a reader sees the whole entry or none. A cache that cannot be
    written only costs the next start a new measurement."""
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(entry)
    except OSError as error:
        _logger.warning("could not cache the matmul timing in %s: %s", entry.parent, error)
