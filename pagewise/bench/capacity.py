"""``pagewise bench capacity``: concurrent requests at one KV byte budget, paged vs static allocation.

A static allocator (HF-style, pre-PagedAttention serving) reserves ``max_model_len`` (2,048) tokens of KV cache for
every request it admits, so a budget of B tokens runs ``floor(B / 2048)`` requests at once whatever their lengths.
Our engine allocates blocks on demand. At the same budget we queue a workload of many requests with realistic
lengths (prompts uniform in [32, 512] tokens, outputs uniform in [16, 256], ``ignore_eos``, greedy), step the
engine and record the peak of ``stats()["num_requests_running"]``. We do not run requests to completion: once no
request has been admitted for ``--settle-steps`` steps (the batch is full) we step ``--settle-steps`` more,
record the running count over those decode steps (``paged_running_sustained_min`` / ``_mean``, which already
include any preemptions as requests grow), and abort the rest.

The default budget is what ``--static-slots`` (6) static reservations of ``max_model_len`` tokens need for this
model's KV geometry; ``--kv-cache-memory-bytes`` sets it directly. ``ratio`` = paged peak / static.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from pagewise.bench._common import Timer, add_model_arg, print_table, progress, random_tokens
from pagewise.exit_status import ExitStatus


def kv_bytes_per_token(model: str, dtype: str = "float32") -> tuple[int, int]:
    """(KV bytes one token needs in all layers, the model's context length) for ``model``."""
    from pagewise.engine.config import EngineConfig
    from pagewise.engine.loader import load_model
    from pagewise.engine.model_runner import KVCache

    torch_dtype = EngineConfig(model=model, dtype=dtype).resolve_precision().kv_cache
    arch = load_model(model, progress=False).arch
    per_token = KVCache.bytes_per_block(arch.num_layers, 1, arch.num_kv_heads, arch.head_dim, torch_dtype)
    return per_token, arch.max_position_embeddings


def run(args: argparse.Namespace) -> int:
    from pagewise import LLM, SamplingParams

    if args.quick:
        max_model_len, num_requests, prompt_range, output_range, settle = 256, 48, (16, 64), (8, 32), 4
        slots = 2
    else:
        max_model_len, num_requests, settle, slots = args.max_model_len, args.num_requests, args.settle_steps, (
            args.static_slots
        )
        prompt_range, output_range = (32, 512), (16, 256)
    clock = Timer()
    per_token, context_len = kv_bytes_per_token(args.model)
    max_model_len = min(max_model_len, context_len)
    budget = args.kv_cache_memory_bytes or slots * max_model_len * per_token
    budget_tokens_raw = budget // per_token
    progress(
        f"KV budget {budget:,} bytes = {budget_tokens_raw:,} tokens ({per_token:,} bytes/token); "
        f"max_model_len {max_model_len}; loading {args.model}, {clock}"
    )
    llm = LLM(
        args.model,
        progress=False,
        kv_cache_memory_bytes=budget,
        max_model_len=max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
    )
    engine = llm.engine
    budget_tokens = engine.num_blocks * engine.block_size  # what the paged cache holds (whole blocks only)
    static = budget_tokens_raw // max_model_len

    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    lengths = [(rng.randint(*prompt_range), rng.randint(*output_range)) for _ in range(num_requests)]
    for i, (prompt_len, output_len) in enumerate(lengths):
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        engine.add_request(f"cap-{i}", random_tokens(prompt_len, vocab, rng), params)
    progress(f"queued {num_requests} requests; stepping, {clock}")

    peak = 0
    peak_blocks = 0
    history: list[int] = []
    idle_admission = 0  # consecutive steps in which the waiting queue did not shrink
    settling = None  # steps left once the batch is full
    last_waiting = engine.stats()["num_requests_waiting"]
    step = 0
    finished = 0
    while engine.has_unfinished_requests() and step < args.max_steps:
        outputs = engine.step()
        step += 1
        finished += sum(o.finished for o in outputs)
        stats = engine.stats()
        running, waiting = stats["num_requests_running"], stats["num_requests_waiting"]
        peak = max(peak, running)
        peak_blocks = max(peak_blocks, stats["kv_blocks_total"] - stats["kv_blocks_free"])
        if settling is None:
            idle_admission = idle_admission + 1 if waiting >= last_waiting else 0
            if idle_admission >= settle or waiting == 0:
                settling = settle
                progress(f"batch full at step {step}: {running} running, {waiting} waiting, {clock}")
        else:
            history.append(running)
            settling -= 1
            if settling == 0:
                break
        last_waiting = waiting
        if step % 5 == 0:
            progress(
                f"step {step}: {running} running (peak {peak}), {waiting} waiting, "
                f"KV {stats['kv_cache_usage_perc']:.0%}, preemptions {stats['num_preemptions']}, {clock}"
            )
    final = engine.stats()
    for i in range(num_requests):
        engine.abort_request(f"cap-{i}")
    progress(f"stopped after {step} steps, aborted the rest, {clock}")

    mean_len = statistics.mean(p + o for p, o in lengths)
    result = {
        "model": engine.model_name,
        "kv_cache_memory_bytes": budget,
        "kv_bytes_per_token": per_token,
        "kv_budget_tokens": budget_tokens_raw,
        "kv_cache_tokens": budget_tokens,
        "kv_blocks_total": engine.num_blocks,
        "block_size": engine.block_size,
        "max_model_len": max_model_len,
        "num_requests": num_requests,
        "prompt_len_range": list(prompt_range),
        "output_len_range": list(output_range),
        "mean_final_len": mean_len,
        "static_concurrent": static,
        "paged_running_peak": peak,
        "paged_running_sustained_min": min(history) if history else peak,
        "paged_running_sustained_mean": statistics.mean(history) if history else float(peak),
        "paged_peak_blocks_in_use": peak_blocks,
        "steps": step,
        "num_finished": finished,
        "num_preemptions": final["num_preemptions"],
        "ratio": peak / static if static else None,
        "ratio_sustained_min": (min(history) if history else peak) / static if static else None,
        "target_ratio_min": 5,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_table(
            [
                ("KV budget bytes", budget),
                ("KV budget tokens", budget_tokens_raw),
                ("max_model_len (static reservation)", max_model_len),
                ("static allocator: concurrent requests", static),
                ("paged: peak running", peak),
                ("paged: running over settle steps, min", result["paged_running_sustained_min"]),
                ("paged: running over settle steps, mean", result["paged_running_sustained_mean"]),
                ("preemptions", final["num_preemptions"]),
                ("ratio (paged peak / static, >= 5)", result["ratio"]),
                ("ratio (sustained min / static)", result["ratio_sustained_min"]),
            ]
        )
    return ExitStatus.OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("capacity", help="concurrent requests at one KV budget, paged vs static")
    add_model_arg(parser)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                        help="KV budget; default: --static-slots x max_model_len tokens for this model")
    parser.add_argument("--static-slots", type=int, default=6,
                        help="default budget = this many static max_model_len reservations")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--settle-steps", type=int, default=8,
                        help="steps without admission that mark the batch full, then steps measured after")
    parser.add_argument("--max-steps", type=int, default=400)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


__all__ = ["kv_bytes_per_token", "register", "run"]
