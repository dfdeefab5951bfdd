"""``pagewise bench prefix``: time to first token with a cached shared system prompt, per tenant.

Every request is a shared system prompt (1,000 random token ids by default) followed by a short distinct suffix,
with ``max_tokens=1`` and greedy sampling. Each repetition starts from an empty prefix cache and runs, in order:

- cold:  tenant A, suffix 0 — nothing cached;
- warm:  tenant A, suffix 1 — the system prompt's full blocks are cached by the cold request;
- cross: tenant B, suffix 2 — the same system prompt, but another tenant's salt, so nothing may be reused.

TTFT is the wall time from ``LLMEngine.add_request`` to the step that returns the first generated token (the
engine holds only this request). We report medians over the repetitions: ``ttft_ratio`` = warm / cold (target
<= 0.10) and ``cross_tenant_ttft_ratio`` = cross / cold (must stay near 1.0: no sharing across tenants), and
each request's ``num_cached_tokens``. One untimed warm-up request of the same shape runs first.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from pagewise.bench._common import Timer, add_model_arg, print_table, progress, random_tokens
from pagewise.exit_status import ExitStatus

KINDS = ("cold", "warm", "cross")


def measure_ttft(engine, request_id: str, tokens: list[int], tenant: str | None) -> tuple[float, int]:
    """Seconds from ``add_request`` to the first generated token, and the request's ``num_cached_tokens``."""
    from pagewise import SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine must be idle to time a request alone")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request(request_id, tokens, params, tenant_id=tenant)
    try:
        while True:
            for output in engine.step():
                if output.request_id == request_id and output.outputs and output.outputs[0].token_ids:
                    return time.perf_counter() - start, output.num_cached_tokens
            if not engine.has_unfinished_requests():
                raise RuntimeError(f"request {request_id} finished without a token")
    finally:
        engine.abort_request(request_id)


def run(args: argparse.Namespace) -> int:
    from pagewise import LLM

    if args.quick:
        system_len, suffix_len, reps = 128, 8, 2
    else:
        system_len, suffix_len, reps = args.system_tokens, args.suffix_tokens, args.repeats
    clock = Timer()
    progress(f"loading {args.model}")
    llm = LLM(args.model, progress=False, max_num_seqs=4, block_size=args.block_size,
              kv_cache_memory_bytes=args.kv_cache_memory_bytes)
    engine = llm.engine
    rng = random.Random(args.seed)
    vocab = engine.arch.vocab_size
    system = random_tokens(system_len, vocab, rng)

    def prompt() -> list[int]:
        return system + random_tokens(suffix_len, vocab, rng)

    progress(f"warm-up request ({system_len + suffix_len} tokens), {clock}")
    measure_ttft(engine, "warmup", random_tokens(system_len + suffix_len, vocab, rng), "warmup")
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    cached: dict[str, list[int]] = {k: [] for k in KINDS}
    for rep in range(reps):
        engine.reset_prefix_cache()
        for kind, tenant in zip(KINDS, ("tenant-a", "tenant-a", "tenant-b"), strict=True):
            seconds, num_cached = measure_ttft(engine, f"{kind}-{rep}", prompt(), tenant)
            times[kind].append(seconds)
            cached[kind].append(num_cached)
        progress(
            f"repeat {rep + 1}/{reps}: cold {times['cold'][-1] * 1e3:.0f} ms, warm {times['warm'][-1] * 1e3:.0f} ms"
            f" ({cached['warm'][-1]} cached), cross-tenant {times['cross'][-1] * 1e3:.0f} ms"
            f" ({cached['cross'][-1]} cached), {clock}"
        )
    median = {k: statistics.median(v) for k, v in times.items()}
    result = {
        "model": engine.model_name,
        "system_prompt_tokens": system_len,
        "suffix_tokens": suffix_len,
        "prompt_tokens": system_len + suffix_len,
        "block_size": engine.block_size,
        "repeats": reps,
        "ttft_cold_s": median["cold"],
        "ttft_warm_s": median["warm"],
        "ttft_cross_tenant_s": median["cross"],
        "ttft_ratio": median["warm"] / median["cold"],
        "cross_tenant_ttft_ratio": median["cross"] / median["cold"],
        "num_cached_tokens_cold": cached["cold"],
        "num_cached_tokens_warm": cached["warm"],
        "num_cached_tokens_cross_tenant": cached["cross"],
        "ttft_s_by_repeat": dict(times),
        "target_ttft_ratio_max": 0.10,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_table(
            [
                ("prompt tokens (system + suffix)", f"{system_len} + {suffix_len}"),
                ("TTFT cold, median ms", median["cold"] * 1e3),
                ("TTFT warm (same tenant), median ms", median["warm"] * 1e3),
                ("TTFT cross-tenant, median ms", median["cross"] * 1e3),
                ("cached tokens cold / warm / cross", " / ".join(
                    str(int(statistics.median(cached[k]))) for k in KINDS)),
                ("ttft_ratio (warm / cold, <= 0.10)", result["ttft_ratio"]),
                ("cross_tenant_ttft_ratio (~1.0)", result["cross_tenant_ttft_ratio"]),
            ]
        )
    return ExitStatus.OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("prefix", help="TTFT with a cached shared system prompt, same vs other tenant")
    add_model_arg(parser)
    parser.add_argument("--system-tokens", type=int, default=1000, help="shared system prompt length")
    parser.add_argument("--suffix-tokens", type=int, default=24, help="distinct suffix length per request")
    parser.add_argument("--repeats", type=int, default=5, help="repetitions; medians are reported")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 * 1024**2)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


__all__ = ["measure_ttft", "register", "run"]
