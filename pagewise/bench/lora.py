"""``pagewise bench lora``: many adapters batched together vs the base model alone, and vs serving one merged
adapter at a time.

Workload: the "mixed" one of ``bench throughput`` (64 requests, prompts of 32–512 random tokens, 16–256 output
tokens with ``ignore_eos``, greedy), request ``i`` under adapter ``i mod N``. Adapters are random, rank
``--rank`` on all seven projections, written in PEFT's format to a temporary directory (nothing downloaded). One
engine serves every run (``enable_lora``, ``--max-loras`` slots): the base model alone, then N = each of
``--adapters`` (more adapters than slots: eviction included), the prefix cache emptied before each run.

The merged baseline is what serving fine-tunes without batched LoRA costs: for each adapter in turn, its weights
merged into the base projections (``W + scaling · B A``, the projections re-prepared for the matmul path), its
requests run as one batch, the weights restored — the merges and restores inside the timing.

``delta_ms`` times the adapter deltas alone for one step over the model's own projections (every layer): 64
decode rows of 8 adapters and a 512-row prefill chunk of one, compiled op vs torch form (``--delta-only``: just
that).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagewise.bench._common import progress as log
from pagewise.bench.throughput import make_workload
from pagewise.exit_status import ExitStatus

if TYPE_CHECKING:
    from pagewise import LLM, LoRARequest
    from pagewise.bench.throughput import Workload

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(directory: Path, arch, rank: int, seed: int) -> None:
    """A random rank-``rank`` adapter on every projection, in PEFT's file format (``lora_alpha = 2 r``)."""
    from safetensors.torch import save_file

    from pagewise.engine.adapter_files import CONFIG_FILE, PROJECTIONS, WEIGHTS_FILE, projection_shapes

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(arch.num_layers):
        for proj, (d_in, d_out) in projection_shapes(arch).items():
            prefix = f"base_model.model.model.layers.{layer}.{PROJECTIONS[proj]}.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen) / d_in**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen) * 0.01
    directory.mkdir(parents=True)
    save_file(tensors, str(directory / WEIGHTS_FILE))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (directory / CONFIG_FILE).write_text(json.dumps(config))


def _params(workload: Workload):
    from pagewise import SamplingParams

    return [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]


def timed_run(llm: LLM, workload: Workload, adapters: list[LoRARequest | None]) -> float:
    """Output tokens/s of the whole workload in one ``generate``, request ``i`` under ``adapters[i]``."""
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, _params(workload), use_tqdm=False, lora_request=adapters)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {workload.num_output_tokens}")
    return produced / elapsed


@contextmanager
def merged(llm: LLM, lora_request: LoRARequest):
    """The engine's base projections with ``lora_request``'s adapter merged in, restored on exit."""
    from pagewise.engine.adapter_slots import read_adapter

    engine = llm.engine
    adapter = read_adapter(lora_request, engine.arch, engine.config.max_lora_rank)
    saved = []
    with torch.inference_mode():
        for projection in engine.model.lora_projections():
            linear, deltas = projection.linear, []
            for name, size in projection.parts:
                pair = adapter.weights.get((projection.layer, name))
                if pair is None:
                    deltas.append(torch.zeros(size, linear.in_features))
                else:
                    deltas.append(adapter.scaling * (torch.from_numpy(pair[1]) @ torch.from_numpy(pair[0])))
            saved.append((linear, linear.weight.detach().clone()))
            linear.weight += torch.cat(deltas).to(linear.weight.dtype)
            linear.use_gemm_plan(engine.gemm.plan, engine.precision.matmul)
    try:
        yield
    finally:
        with torch.inference_mode():
            for linear, weight in saved:
                linear.weight.copy_(weight)
                linear.use_gemm_plan(engine.gemm.plan, engine.precision.matmul)


def merged_run(llm: LLM, workload: Workload, adapters: list[LoRARequest]) -> float:
    """Output tokens/s serving one merged adapter at a time: each adapter's requests as one batch."""
    start = time.perf_counter()
    produced = 0
    for index, adapter in enumerate(adapters):
        mine = [i for i in range(len(workload.prompts)) if i % len(adapters) == index]
        with merged(llm, adapter):
            llm.reset_prefix_cache()
            params = _params(workload)
            outputs = llm.generate([workload.prompts[i] for i in mine], [params[i] for i in mine], use_tqdm=False)
        produced += sum(len(o.outputs[0].token_ids) for o in outputs)
    return produced / (time.perf_counter() - start)


DELTA_CASES = ((64, 8), (512, 1))  # (rows, adapters): a decode step of 64 sequences, a prefill chunk of one


def time_lora_delta(llm: LLM, backend: str, rows: int, num_adapters: int, repeats: int = 5) -> float:
    """Milliseconds the adapter deltas of one step take on ``backend`` (``cpu``: the compiled op, ``torch``: its
    torch form): every targeted projection of every layer, ``rows`` rows spread over ``num_adapters`` slots,
    random inputs in the projections' dtype; the best of ``repeats``. (Fewer slots than ``num_adapters``: the rows
    spread over every slot.)"""
    from pagewise.kernels import cpu_ops, lora
    from pagewise.kernels.lora import LoraBatch

    lora_add = {"cpu": cpu_ops.lora_add, "torch": lora.lora_add}[backend]

    engine = llm.engine
    projections = engine.model.lora_projections()
    slots = min(num_adapters, engine.config.max_loras)
    batch = LoraBatch.build([i % slots for i in range(rows)], [1.0] * engine.config.max_loras, engine.device)
    inputs = []
    for projection in projections:
        linear = projection.linear
        x = torch.randn(rows, linear.in_features).to(linear.compute_dtype)
        inputs.append((linear, x, torch.zeros(rows, linear.out_features, dtype=linear.compute_dtype)))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for linear, x, y in inputs:
            lora_add(y, x, linear.lora_a, linear.lora_b, batch, linear.lora_column_bounds)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def delta_timings(llm: LLM) -> dict[str, dict[str, float]]:
    """``time_lora_delta`` for each case of ``DELTA_CASES`` on the compiled op (where built) and the torch form."""
    from pagewise.kernels import cpu_ops

    backends = ["cpu", "torch"] if llm.engine.device.type == "cpu" and cpu_ops.available() else ["torch"]
    return {
        f"{rows}_rows_{adapters}_adapters": {b: time_lora_delta(llm, b, rows, adapters) for b in backends}
        for rows, adapters in DELTA_CASES
    }


def vllm_side_by_side(
    args: argparse.Namespace,
    workload: Workload,
    adapter_dirs: list[str],
    counts: list[int],
    base: float,
    by_count: dict[str, dict[str, float]],
) -> dict[str, object]:
    """The same requests, adapters and slots through vLLM's CPU build (``bench vllm``'s environment and driver),
    after pagewise's runs: its output tokens/s per run, and pagewise's over vLLM's for each."""
    from pagewise.bench.versus_vllm import (
        default_home,
        ensure_environment,
        ensure_weights,
        vllm_dtype_for,
        vllm_offline,
    )

    home = Path(args.vllm_home).expanduser() if args.vllm_home else default_home()
    python = ensure_environment(home)
    weights = ensure_weights(args.model, home)
    runs = [{"name": "base", "adapters": None}] + [
        {"name": str(count), "adapters": [adapter_dirs[i % count] for i in range(len(workload.prompts))]}
        for count in counts
    ]
    lora = {"max_loras": args.max_loras, "max_lora_rank": args.rank, "max_cpu_loras": max(args.max_loras, *counts)}
    dtype = vllm_dtype_for(args.dtype)
    log(f"vLLM ({dtype}): the base model, then {', '.join(map(str, counts))} adapters")
    figures = vllm_offline(python, weights, workload, dtype, False, len(os.sched_getaffinity(0)),
                           {"lora": lora, "runs": runs})
    ours = {"base": base, **{count: row["tokens_per_s"] for count, row in by_count.items()}}
    out: dict[str, object] = {"vllm_version": figures["vllm_version"], "dtype": dtype}
    for name, run_figures in figures["runs"].items():
        rate = run_figures["output_tokens_per_s"]
        out[name] = {"vllm_tokens_per_s": rate, "pagewise_vs_vllm": ours[name] / rate}
        log(f"vLLM {name}: {rate:.1f} out tok/s (pagewise {ours[name] / rate:.2f}x)")
    return out


def run(args: argparse.Namespace) -> int:
    from pagewise import LLM, LoRARequest

    counts = sorted({int(n) for n in args.adapters.split(",")})
    if args.quick:
        num, prompt_range, output_range = 16, (32, 128), (8, 32)
    else:
        num, prompt_range, output_range = 64, (32, 512), (16, 256)
    llm = LLM(
        args.model, enable_lora=True, max_loras=args.max_loras, max_lora_rank=args.rank, dtype=args.dtype,
        progress=False,
    )  # fmt: skip
    engine = llm.engine
    workload = make_workload(num, prompt_range, output_range, engine.arch.vocab_size, seed=args.seed)
    result: dict[str, object] = {
        "num_requests": num,
        "num_output_tokens": workload.num_output_tokens,
        "rank": args.rank,
        "max_loras": args.max_loras,
        "precision": engine.precision.describe(),
        "gemm_path": engine.gemm.plan.describe(),
        "delta_ms": delta_timings(llm),
    }
    log(f"LoRA delta per step, ms: {result['delta_ms']}")
    if args.delta_only:
        print(json.dumps(result) if args.json else result["delta_ms"])
        return ExitStatus.OK
    with tempfile.TemporaryDirectory(prefix="pagewise-lora-bench-") as tmp:
        requests = []
        for index in range(max(counts)):
            directory = Path(tmp) / f"adapter-{index}"
            write_random_adapter(directory, engine.arch, args.rank, seed=args.seed * 1000 + index)
            requests.append(LoRARequest(f"adapter-{index}", index + 1, str(directory)))
        log(f"workload: {num} requests, {workload.num_output_tokens} output tokens; {max(counts)} adapters")
        base = timed_run(llm, workload, [None] * num)
        result["base_tokens_per_s"] = base
        log(f"base model alone: {base:.1f} out tok/s")
        by_count = {}
        for count in counts:
            loads = engine.adapters.loads
            rate = timed_run(llm, workload, [requests[i % count] for i in range(num)])
            by_count[str(count)] = {
                "tokens_per_s": rate,
                "vs_base": rate / base,
                "slot_loads": engine.adapters.loads - loads,
            }
            log(f"{count} adapters: {rate:.1f} out tok/s ({rate / base:.2f}x base)")
        result["adapters"] = by_count
        merged_rates = {}
        for count in sorted({int(n) for n in args.merged.split(",") if n}):
            rate = merged_run(llm, workload, requests[:count])
            batched = by_count[str(count)]["tokens_per_s"] if str(count) in by_count else None
            merged_rates[str(count)] = {
                "tokens_per_s": rate,
                "batched_vs_merged": None if batched is None else batched / rate,
            }
            log(f"{count} adapters merged one at a time: {rate:.1f} out tok/s")
        result["merged_one_at_a_time"] = merged_rates
        if args.vllm:
            result["vllm"] = vllm_side_by_side(args, workload, [r.lora_path for r in requests], counts, base, by_count)
    if args.json:
        print(json.dumps(result))
    else:
        for count, row in by_count.items():
            print(f"{count:>3} adapters  {row['tokens_per_s']:8.1f} out tok/s  {row['vs_base']:.2f}x base")
        for count, row in merged_rates.items():
            ratio = row["batched_vs_merged"]
            print(f"{count:>3} merged    {row['tokens_per_s']:8.1f} out tok/s  batched is {ratio:.2f}x")
    return ExitStatus.OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("lora", help="adapters batched together vs base alone and vs merged ones")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small workload for smoke tests")
    parser.add_argument("--adapters", default="1,8,32", help="adapter counts to run (default: 1,8,32)")
    parser.add_argument(
        "--merged", default="8,32", help="adapter counts to run merged one at a time (default: 8,32)"
    )
    parser.add_argument("--max-loras", type=int, default=24, help="adapter slots (default: 24)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--delta-only", action="store_true", help="only time the LoRA delta of one step (compiled op vs torch form)"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="default: auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vllm", action="store_true", help="then the same requests and adapters through vLLM's CPU build (bench vllm)"
    )
    parser.add_argument("--vllm-home", help="vLLM's environment (default: bench vllm's)")
    parser.set_defaults(func=run)


__all__ = ["register", "run", "write_random_adapter"]
