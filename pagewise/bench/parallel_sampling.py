"""``pagewise bench parallel-sampling``: KV blocks for one n = 8 request vs 8 independent requests.

One request with ``SamplingParams(n=8, temperature=0.8, seed=0, max_tokens=64, ignore_eos=True)`` and a
512-token prompt prefills once and forks: the prompt's blocks exist once and each sample only owns the blocks of
its own output (plus a copy-on-write copy of a partial last prompt block, if any). The baseline is measured, not
computed: the same prompt as 8 concurrent independent requests (same sampling, seeds 0..7) on the same engine with
prefix caching off, so each holds its own copy of the prompt. Blocks in use (``kv_blocks_total -
kv_blocks_free``) are sampled after every step; ``block_ratio`` = peak for n = 8 / peak for the baseline
(target <= 0.25).
"""

from __future__ import annotations

import argparse
import json
import random

from pagewise.bench._common import Timer, add_model_arg, blocks_in_use, print_table, progress, random_tokens
from pagewise.exit_status import ExitStatus


def peak_blocks(engine, requests: list[tuple[str, list[int], object]], label: str, clock: Timer) -> tuple[int, int]:
    """Run ``requests`` (id, prompt, params) together to completion; (peak blocks in use, tokens generated)."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    peak = blocks_in_use(engine)
    generated = 0
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                generated += sum(len(c.token_ids) for c in output.outputs)
        step += 1
        peak = max(peak, blocks_in_use(engine))
        if step % 16 == 0:
            progress(f"{label}: step {step}, {blocks_in_use(engine)} blocks in use (peak {peak}), {clock}")
    return peak, generated


def run(args: argparse.Namespace) -> int:
    from pagewise import LLM, SamplingParams

    n = args.n
    prompt_len, max_tokens = (64, 8) if args.quick else (args.prompt_tokens, args.max_tokens)
    clock = Timer()
    progress(f"loading {args.model}")
    llm = LLM(
        args.model,
        progress=False,
        enable_prefix_caching=False,
        block_size=args.block_size,
        max_num_seqs=max(n, 8),
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
    )
    engine = llm.engine
    prompt = random_tokens(prompt_len, engine.arch.vocab_size, random.Random(args.seed))
    common = dict(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)

    progress(f"n={n}: one request, {prompt_len}-token prompt, {max_tokens} output tokens, {clock}")
    forked, forked_tokens = peak_blocks(
        engine, [("parallel", prompt, SamplingParams(n=n, seed=args.seed, **common))], f"n={n}", clock
    )
    progress(f"n={n}: peak {forked} blocks; now {n} independent requests, {clock}")
    independent, independent_tokens = peak_blocks(
        engine,
        [(f"independent-{i}", prompt, SamplingParams(seed=args.seed + i, **common)) for i in range(n)],
        "independent",
        clock,
    )
    if forked_tokens != n * max_tokens or independent_tokens != n * max_tokens:
        raise RuntimeError(f"expected {n * max_tokens} tokens, got {forked_tokens} and {independent_tokens}")
    block_size = engine.block_size
    result = {
        "model": engine.model_name,
        "n": n,
        "prompt_tokens": prompt_len,
        "max_tokens": max_tokens,
        "block_size": block_size,
        "prompt_blocks": -(-prompt_len // block_size),
        "parallel_peak_blocks": forked,
        "independent_peak_blocks": independent,
        "baseline": f"measured: {n} concurrent independent requests, same prompt, prefix caching off",
        "block_ratio": forked / independent,
        "target_block_ratio_max": 0.25,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_table(
            [
                ("prompt / output tokens", f"{prompt_len} / {max_tokens}"),
                ("block size", block_size),
                (f"peak KV blocks, one n={n} request", forked),
                (f"peak KV blocks, {n} independent requests", independent),
                ("block_ratio (<= 0.25)", result["block_ratio"]),
            ]
        )
    return ExitStatus.OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("parallel-sampling", help="KV blocks: one n=8 request vs 8 independent ones")
    add_model_arg(parser)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=512 * 1024**2)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


__all__ = ["peak_blocks", "register", "run"]
