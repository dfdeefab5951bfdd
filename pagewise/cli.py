"""``pagewise`` command line: generate | bench … | serve | worker | db | tenants | keys."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagewise.exit_status import ExitStatus
from pagewise.jobs import cli as jobs_cli
from pagewise.platform import cli as platform_cli
from pagewise.platform.billing import cli as billing_cli
from pagewise.worker import cli as worker_cli


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine flags with vLLM's names. Every default is None ("not given"), so ``EngineConfig``'s defaults —
    or, for the server, ``PAGEWISE_*`` environment variables — apply unless a flag is passed."""
    group = parser.add_argument_group("engine (defaults: see EngineConfig)")
    group.add_argument("--model", help="model name, HF directory or .gguf file (default: smollm2-135m-instruct)")
    group.add_argument(
        "--served-model-name",
        help="the name(s) the model is served under, comma-separated: the first is listed, the rest are aliases "
        "(default: --model as given)",
    )
    group.add_argument("--block-size", type=int)
    group.add_argument("--max-num-seqs", type=int)
    group.add_argument("--max-num-batched-tokens", type=int)
    group.add_argument(
        "--fair-max-num-batched-tokens",
        type=int,
        help="fair policy: the step budget while two or more tenants are active (default: the full budget)",
    )
    group.add_argument(
        "--no-enable-step-interrupts",
        dest="enable_step_interrupts",
        action="store_false",
        default=None,
        help="run every step whole: no request owed service (a better priority, a far less served tenant) may "
        "pause a step between two parts of a layer (its attention, its MLP in 512-row parts)",
    )
    group.add_argument("--interrupt-max-num-batched-tokens", type=int, help="an interrupting step's budget (256)")
    group.add_argument("--max-interrupts-per-step", type=int, help="interrupting steps per paused step (4)")
    group.add_argument("--max-model-len", type=int)
    group.add_argument("--kv-cache-memory-bytes", type=int)
    group.add_argument("--gpu-memory-utilization", type=float)
    group.add_argument("--swap-space-bytes", type=int)
    group.add_argument("--preemption-mode", choices=["recompute", "swap"])
    group.add_argument(
        "--scheduling-policy",
        choices=["fcfs", "fair"],
        help="fcfs, or fair: tenants share the engine by weighted served tokens (default: fcfs; serve: fair)",
    )
    group.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false", default=None)
    group.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false", default=None)
    group.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        help="auto (default): bf16 projections where the CPU multiplies bf16 natively, else fp32; float32 is exact",
    )
    group.add_argument(
        "--gemm-path",
        help="matmul path of the projections: auto (default: the fastest here, timed once per CPU kind), torch or "
        "onednn-packed; `pagewise bench gemm` times them",
    )
    group.add_argument(
        "--enable-lora",
        action="store_true",
        default=None,
        help="serve LoRA adapters batched with the base model (on by default in serve and worker)",
    )
    group.add_argument("--no-enable-lora", dest="enable_lora", action="store_false", default=None)
    group.add_argument("--max-loras", type=int, help="adapters resident at once (4)")
    group.add_argument("--max-lora-rank", type=int, help="the highest adapter rank accepted (16)")
    group.add_argument("--max-cpu-loras", type=int, help="adapters kept in host memory (max(max_loras, 32))")
    group.add_argument("--device", help="cpu or cuda[:N]")
    group.add_argument("--seed", type=int)
    group.add_argument("--cache-dir", help="where converted weights are cached")


def engine_config_from_args(args: argparse.Namespace):
    """An ``EngineConfig`` from the flags that were given (validated on construction)."""
    from dataclasses import fields

    from pagewise.engine.config import EngineConfig

    given = {f.name: getattr(args, f.name, None) for f in fields(EngineConfig)}
    return EngineConfig(**{name: value for name, value in given.items() if value is not None})


def _generate(args: argparse.Namespace) -> int:
    from pathlib import Path

    from pagewise.engine.errors import InvalidConfigError, InvalidRequestError
    from pagewise.engine.llm import LLM
    from pagewise.engine.lora_request import LoRARequest
    from pagewise.engine.sampling_params import SamplingParams

    try:
        if args.lora is not None:
            args.enable_lora = True
        config = engine_config_from_args(args)
        llm = LLM.from_config(config)
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=config.seed
        )
        adapter = None if args.lora is None else LoRARequest(Path(args.lora).name or "adapter", 1, args.lora)
        if args.chat:
            prompts = [[{"role": "user", "content": p}] for p in args.prompts]
            outputs = llm.chat(prompts, params, lora_request=adapter)
        else:
            outputs = llm.generate(args.prompts, params, lora_request=adapter)
    except (InvalidConfigError, InvalidRequestError) as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.STARTUP_ERROR
    for prompt, output in zip(args.prompts, outputs, strict=True):
        completion = output.outputs[0]
        print(
            f"### {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n"
        )
    return ExitStatus.OK


def build_parser(*, with_bench: bool = True) -> argparse.ArgumentParser:
    """The whole command line. `with_bench=False` leaves out the benchmarks' own flags: they import torch, which
    `pagewise serve --workers-external` (an API replica) and the admin commands never need."""
    parser = argparse.ArgumentParser(prog="pagewise", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser(
        "generate", help="generate completions for prompts",
        description="Each PROMPT argument is one prompt, batched together: quote a prompt that has spaces "
        "(`pagewise generate \"Hello world\"` is one prompt, `pagewise generate Hello world` two).",
    )
    gen.add_argument("prompts", nargs="+", metavar="PROMPT", help="one prompt per argument (quote spaces)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--chat", action="store_true", help="apply the model's chat template to each prompt")
    gen.add_argument(
        "--lora", metavar="DIR", help="run every prompt under this LoRA adapter (PEFT's files; turns --enable-lora on)"
    )
    add_engine_arguments(gen)
    gen.set_defaults(func=_generate)
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    if with_bench:
        from pagewise.bench import (
            batch,
            capacity,
            fairness,
            faults,
            gemm,
            kernels,
            lora,
            parallel_sampling,
            prefix,
            serving,
            step,
            throughput,
            versus_vllm,
        )
        from pagewise.bench import tracing as tracing_bench

        modules = (
            throughput, prefix, capacity, parallel_sampling, kernels, serving, fairness, step, tracing_bench, gemm,
            faults, versus_vllm, batch, lora,
        )
        for module in modules:
            module.register(bench)
    platform_cli.register(commands, add_engine_arguments)
    billing_cli.register(commands)
    jobs_cli.register(commands)
    worker_cli.register(commands, add_engine_arguments)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(with_bench="bench" in argv[:1]).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
