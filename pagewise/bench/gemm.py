"""``pagewise bench gemm [--json]``: the matmul paths this machine has, timed on a model's own projections, and
the one the engine runs with.

Each path (``pagewise.kernels.gemm``) computes one forward's projections (fused qkv, o, gate/up, down per layer,
plus the LM head) at the row counts the engine's start-up timing uses (a few decodes, a decode batch, a prefill
chunk). ``candidates`` is each path's GFLOP/s over all of them; ``by_rows`` splits it by row count; ``fastest``
is the plan this run's timing makes (the fastest path per band of row counts, ``GemmTiming.plan``), ``chosen``
the engine's own (``gemm_selection``: from its per-CPU cache when it has timed this machine kind before, so the
two can differ when paths are within noise of each other), each as its description and as ``[bound, path]``
bands (``fastest_bands``, ``chosen_bands``). Where the compiled few-rows product runs for the dtype,
``few_rows`` has its timing against the smallest rows' path at 1 to 16 rows (the weights streamed from memory,
as in a step), the limit this run's timing gives and the engine's own.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from pagewise.exit_status import ExitStatus

_FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")


def run(args: argparse.Namespace) -> int:
    from pagewise.engine.config import EngineConfig
    from pagewise.engine.gemm_selection import TIMED_ROWS, select_gemm_path, time_few_rows_against, weight_shapes
    from pagewise.engine.loader import cache_root, load_model
    from pagewise.kernels.gemm import (
        cpu_signature,
        few_rows_product_available,
        supported_paths,
        time_paths,
    )

    matmul = EngineConfig(model=args.model, dtype=args.dtype).resolve_precision().matmul
    arch = load_model(args.model, progress=False).arch
    device = torch.device("cpu")
    paths = supported_paths(device, matmul)
    dtype = str(matmul).removeprefix("torch.")
    print(f"timing {', '.join(paths)} on {args.model}'s projections ({dtype})", flush=True)
    timing = time_paths(paths, weight_shapes(arch), TIMED_ROWS, matmul)
    fastest = timing.plan()
    available = few_rows_product_available(matmul)
    few = time_few_rows_against(fastest, weight_shapes(arch), matmul) if available else None
    chosen = select_gemm_path("auto", arch, device, matmul, cache_root(None))
    name, _, flags = cpu_signature().partition(" | ")
    result: dict[str, Any] = {
        "cpu": name,
        "cpu_flags": [f for f in _FLAGS_OF_INTEREST if f in flags.split()],
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "model": args.model,
        "candidates": {p.value: round(timing.gflops(p), 2) for p in paths},
        "by_rows": {str(m): {p.value: round(timing.gflops_at(p, m), 2) for p in paths} for m in TIMED_ROWS},
        "fastest": fastest.describe(),
        "fastest_bands": fastest.as_json(),
        "chosen": chosen.plan.describe(),
        "chosen_bands": chosen.plan.as_json(),
        "chosen_source": chosen.source,
        "few_rows": None
        if few is None
        else {
            "by_rows": {str(m): {k: round(v, 2) for k, v in g.items()} for m, g in few.gflops().items()},
            "limit_now": few.limit(),
            "limit": chosen.plan.few_rows,
        },
    }
    if args.json:
        print(json.dumps(result))
        return ExitStatus.OK
    print(f"cpu: {name} ({', '.join(result['cpu_flags'])}), {result['threads']} threads")
    print(f"{'rows':>6} " + " ".join(f"{p.value:>14}" for p in paths))
    for m in TIMED_ROWS:
        print(f"{m:>6} " + " ".join(f"{timing.gflops_at(p, m):>14.1f}" for p in paths))
    print(f"{'all':>6} " + " ".join(f"{timing.gflops(p):>14.1f}" for p in paths))
    print(f"fastest now: {result['fastest']}; the engine runs: {result['chosen']} ({result['chosen_source']})")
    if few is not None:
        print("few rows, weights from memory (the smallest rows' path vs the few-rows product):")
        for m, rates in few.gflops().items():
            print(f"{m:>6} {rates['path']:>14.1f} {rates['few-rows']:>14.1f}")
        print(f"the few-rows product pays up to {few.limit()} rows now; the engine's limit: {chosen.plan.few_rows}")
    return ExitStatus.OK


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("gemm", help="the matmul paths on a model's shapes, GFLOP/s, and the chosen one")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="the projections' dtype; auto: the engine's default on this CPU",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)
