"""``pagewise bench throughput``: our engine vs HF transformers static batching on one seeded workload.

Workload (TARGETS.md, "mixed"): N requests, random prompt token ids with lengths uniform in [32, 512], output
lengths uniform in [16, 256] with ``ignore_eos``, greedy (``--sampled``: temperature 0.8, top-p 0.95, top-k 50).
HF runs padded batches of 8, 16 and 32, each batch until its longest output; we report its best. Output tokens/s
counts only the tokens each request asked for; total tokens/s adds the prompts.

``roofline_fraction`` puts total tokens/s against what this machine's best matmul path allows: a token costs two
flops per weight of the model's matmuls (attention and the rest left out), and the rate is measured in the same
run on the model's own projections at a prefill chunk's rows, every path this machine has (``pagewise.kernels.
gemm``) in the engine's matmul dtype (bf16 under ``dtype=auto`` on a CPU with native bf16) and the fastest kept
— not MKL's fp32 alone — so the fraction compares like with like on whatever CPU.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pagewise.bench._common import progress as log
from pagewise.exit_status import ExitStatus

if TYPE_CHECKING:
    from pagewise import LLM


@dataclass(slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def make_workload(
    num_requests: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(vocab_size) for _ in range(rng.randint(*prompt_range))] for _ in range(num_requests)
    ]
    return Workload(prompts, [rng.randint(*output_range) for _ in range(num_requests)])


SAMPLED = {"temperature": 0.8, "top_p": 0.95, "top_k": 50}
_ROOFLINE_ROWS = 512  # a prefill chunk: the step size at which every path runs fastest


def best_gemm_gflops(llm: LLM) -> tuple[str, float]:
    """This machine's best matmul rate (GFLOP/s) on the model's own projections in the engine's matmul dtype:
    every path it supports, timed at a prefill chunk's rows; the fastest path and its rate."""
    from pagewise.engine.gemm_selection import weight_shapes
    from pagewise.kernels.gemm import supported_paths, time_paths

    engine = llm.engine
    dtype = engine.precision.matmul
    paths = supported_paths(engine.device, dtype)
    timing = time_paths(paths, weight_shapes(engine.arch), (_ROOFLINE_ROWS,), dtype)
    best = max(paths, key=timing.gflops)
    return best.value, timing.gflops(best)


def matmul_flops_per_token(model: torch.nn.Module) -> int:
    """Two flops per weight of every linear layer (the LM head included, tied or not)."""
    return 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def run_engine(llm: LLM, workload: Workload, sampled: bool = False) -> dict[str, float]:
    from pagewise import SamplingParams

    mode = SAMPLED if sampled else {"temperature": 0}
    params = [SamplingParams(**mode, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(workload.prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    if produced != workload.num_output_tokens:
        raise RuntimeError(f"engine produced {produced} tokens, expected {workload.num_output_tokens}")
    return {
        "engine_seconds": elapsed,
        "engine_tokens_per_s": produced / elapsed,
        "total_tokens_per_s": (produced + workload.num_prompt_tokens) / elapsed,
        "kv_utilization_peak": llm.engine.kv_utilization_at_peak,
        "num_preemptions": llm.stats()["num_preemptions"],
    }


def load_hf_model(model: str):
    import transformers

    from pagewise.engine.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    return hf.eval()


def run_hf(hf_model, workload: Workload, batch_size: int, sampled: bool = False) -> float:
    """Seconds for HF static batching: left-padded batches in arrival order, each run to its longest output."""
    start = time.perf_counter()
    for begin in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[begin : begin + batch_size]
        longest = max(workload.output_lens[begin : begin + batch_size])
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros(len(prompts), width, dtype=torch.long)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            mask[row, width - len(prompt) :] = 1
        with torch.inference_mode():
            hf_model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                **({"do_sample": True, **SAMPLED} if sampled else {"do_sample": False}),
                eos_token_id=None,
                pad_token_id=0,
            )
        log(
            f"  hf batch {batch_size}: {min(begin + batch_size, len(workload.prompts))}/{len(workload.prompts)}"
            f" requests, {time.perf_counter() - start:.0f} s"
        )
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> int:
    if args.quick:
        num, prompt_range, output_range, batch_sizes = 8, (32, 128), (8, 32), [8]
    else:
        num, prompt_range, output_range, batch_sizes = 64, (32, 512), (16, 256), [8, 16, 32]
    from pagewise import LLM

    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    llm = LLM(
        args.model,
        max_num_seqs=args.max_num_seqs,
        gemm_path=args.gemm_path,
        dtype=args.dtype,
        progress=False,
        **budget,
    )
    workload = make_workload(num, prompt_range, output_range, llm.engine.arch.vocab_size, seed=args.seed)
    log(
        f"workload: {num} requests, {workload.num_prompt_tokens} prompt + {workload.num_output_tokens} "
        f"output tokens; torch threads {torch.get_num_threads()}"
    )
    result: dict[str, object] = {
        "max_num_batched_tokens": llm.engine.max_num_batched_tokens,
        "gemm_path": llm.engine.gemm.plan.describe(),
        "precision": llm.engine.precision.describe(),
        "num_requests": num,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
    }
    result.update(run_engine(llm, workload, sampled=args.sampled))
    best_path, gflops = best_gemm_gflops(llm)
    roofline = gflops * 1e9 / matmul_flops_per_token(llm.engine.model)
    result.update(
        sampled=args.sampled,
        gemm_gflops=gflops,
        gemm_gflops_path=best_path,
        roofline_tokens_per_s=roofline,
        roofline_fraction=result["total_tokens_per_s"] / roofline,
    )
    log(f"engine: {result['engine_tokens_per_s']:.1f} output tok/s")
    if not args.skip_hf:
        hf_model = load_hf_model(args.model)
        hf = {b: workload.num_output_tokens / run_hf(hf_model, workload, b, args.sampled) for b in batch_sizes}
        best = max(hf, key=hf.get)
        result.update(
            hf_tokens_per_s=hf[best],
            hf_best_batch_size=best,
            hf_tokens_per_s_by_batch={str(b): v for b, v in hf.items()},
            ratio=result["engine_tokens_per_s"] / hf[best],
        )
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return ExitStatus.OK


def _print_table(result: dict) -> None:
    rows = [
        ("engine output tok/s", result["engine_tokens_per_s"]),
        ("engine prompt+output tok/s", result["total_tokens_per_s"]),
        (f"GEMM GFLOP/s ({result['gemm_gflops_path']})", result["gemm_gflops"]),
        ("roofline fraction (total tok/s)", result["roofline_fraction"]),
        ("kv utilization at peak", result["kv_utilization_peak"]),
    ]
    if "hf_tokens_per_s" in result:
        rows += [
            (f"HF static batch {b} output tok/s", v) for b, v in result["hf_tokens_per_s_by_batch"].items()
        ]
        rows += [("ratio (engine / best HF)", result["ratio"])]
    for name, value in rows:
        print(f"{name:<34} {value:>10.3f}")


def register(subparsers) -> None:
    parser = subparsers.add_parser("throughput", help="engine vs HF static batching, output tokens/s")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small workload for smoke tests")
    parser.add_argument("--skip-hf", action="store_true", help="run only our engine")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.95, top-k 50 (not greedy)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, help="the step's token budget (default: the engine's for the device)"
    )
    parser.add_argument("--gemm-path", default="auto", help="the engine's matmul path (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="default: auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


__all__ = ["Workload", "make_workload", "register", "run"]
