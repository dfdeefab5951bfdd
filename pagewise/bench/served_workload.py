"""``pagewise bench serving --workload mixed``: the throughput workload served over HTTP, against the engine
offline on the same requests.

The "mixed" workload of ``pagewise bench throughput`` (64 requests, random prompt ids of U[32, 512] tokens,
U[16, 256] output tokens, ``ignore_eos``, greedy or ``--sampled``) runs first offline (``LLM.generate`` in this
process), then as streamed ``/v1/completions`` with token-id prompts against ``pagewise serve`` (started here, or
``--url``): all at once, then with Poisson arrivals at each ``--rate`` (arrival gaps drawn from a fixed seed, so
every run and every server sees the same schedule). Reports per load output tokens/s and TTFT / TPOT p50 and p99
as the client sees them, and ``served_offline_ratio``: served (all at once) over offline output tokens/s.

Each load after the first sends prompts of its own (``phase_workloads``: the same prompt and output lengths, fresh
token ids), so no load is served from prefixes an earlier one left in the server's prefix cache.

The offline engine is freed before the server starts: the two never share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import time
from typing import Any

from pagewise.bench._common import latency_summary, served_model
from pagewise.bench._common import progress as log
from pagewise.bench.throughput import SAMPLED, Workload, make_workload, run_engine

NUM_REQUESTS = 64
PROMPT_RANGE = (32, 512)
OUTPUT_RANGE = (16, 256)
ARRIVAL_SEED = 1


def arrival_times(count: int, rate: float, seed: int = ARRIVAL_SEED) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0 for an infinite rate, else Poisson."""
    if math.isinf(rate):
        return [0.0] * count
    rng = random.Random(seed)
    times, at = [], 0.0
    for _ in range(count):
        times.append(at)
        at += rng.expovariate(rate)
    return times


async def _one(client: Any, body: dict[str, Any], delay: float) -> dict[str, float] | str:
    """One streamed completion sent after ``delay``: its TTFT, TPOT and token count, or an error message."""
    await asyncio.sleep(delay)
    start = time.perf_counter()
    first = None
    tokens = 0
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: ") :])
                if "error" in event:
                    return f"error event: {event['error']}"
                if first is None and any(c.get("text") for c in event.get("choices", [])):
                    first = time.perf_counter()
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        return f"{type(error).__name__}: {error}"
    end = time.perf_counter()
    if first is None or tokens == 0:
        return "the stream carried no tokens"
    return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens}


def phase_workloads(workload: Workload, count: int, vocab_size: int) -> list[Workload]:
    """``count`` workloads for consecutive loads on one server: ``workload`` first, then copies with the same
    prompt and output lengths whose prompts are fresh random token ids (seeded by the load's index), so a load's
    prompts share no block with an earlier load's and its TTFT includes the whole prefill."""
    phases = [workload]
    for index in range(1, count):
        rng = random.Random(f"load-{index}")
        prompts = [[rng.randrange(vocab_size) for _ in prompt] for prompt in workload.prompts]
        phases.append(Workload(prompts, list(workload.output_lens)))
    return phases


async def serve_load(base: str, key: str, model: str, workload: Workload, rate: float, sampled: bool) -> dict:
    """The workload against a server at ``rate`` requests/s (``inf``: all at once)."""
    import httpx

    mode = SAMPLED if sampled else {"temperature": 0.0}
    bodies = [
        {"model": model, "prompt": prompt, "max_tokens": n, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}, **mode}
        for prompt, n in zip(workload.prompts, workload.output_lens, strict=True)
    ]
    delays = arrival_times(len(bodies), rate)
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one(client, b, d) for b, d in zip(bodies, delays, strict=True)))
        wall = time.perf_counter() - start
    ok = [r for r in results if isinstance(r, dict)]
    errors = [r for r in results if isinstance(r, str)]
    tokens = sum(r["tokens"] for r in ok)
    summary: dict[str, Any] = {
        "rate": None if math.isinf(rate) else rate,  # None: all at once
        "num_errors": len(errors),
        "errors": errors[:5],
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
    }
    summary.update(latency_summary("ttft", [r["ttft"] for r in ok]))
    summary.update(latency_summary("tpot", [r["tpot"] for r in ok]))
    log(f"served at {rate:g} req/s: {summary['output_tokens_per_s']:.1f} output tok/s, {len(errors)} errors")
    return summary


def serve_loads(
    base: str, key: str, model: str, phases: list[Workload], rates: list[float], sampled: bool
) -> list[dict]:
    """One ``serve_load`` per rate, in order, each with its phase's workload (``phase_workloads``)."""
    return [
        asyncio.run(serve_load(base, key, model, phase, rate, sampled))
        for phase, rate in zip(phases, rates, strict=True)
    ]


def offline(model: str, max_model_len: int, sampled: bool, num_requests: int) -> tuple[Workload, dict, int]:
    """The workload, the engine's offline figures on it and the model's vocabulary size (the engine is freed
    afterwards)."""
    from pagewise import LLM

    llm = LLM(model, max_model_len=max_model_len, progress=False)
    vocab_size = llm.engine.arch.vocab_size
    workload = make_workload(num_requests, PROMPT_RANGE, OUTPUT_RANGE, vocab_size)
    log(f"offline: {num_requests} requests, {workload.num_prompt_tokens} prompt + {workload.num_output_tokens} output")
    figures = run_engine(llm, workload, sampled=sampled)
    del llm
    gc.collect()
    log(f"offline: {figures['engine_tokens_per_s']:.1f} output tok/s")
    return workload, figures, vocab_size


def run_mixed(args: argparse.Namespace, server) -> dict[str, Any]:
    """Offline, then every load through ``server`` (a context manager yielding base URL, key and admin key)."""
    workload, engine, vocab_size = offline(args.model, args.max_model_len, args.sampled, args.num_requests)
    result: dict[str, Any] = {
        "workload": "mixed",
        "sampled": args.sampled,
        "num_requests": args.num_requests,
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "offline_output_tokens_per_s": engine["engine_tokens_per_s"],
    }
    with server as (base, key, _admin_key):
        model = served_model(base, key, args.model)
        phases = phase_workloads(workload, len(args.rates), vocab_size)
        loads = serve_loads(base, key, model, phases, args.rates, args.sampled)
    result["loads"] = loads
    result["num_errors"] = sum(load["num_errors"] for load in loads)
    burst = next((load for load in loads if load["rate"] is None), None)
    if burst is not None:
        result["served_offline_ratio"] = burst["output_tokens_per_s"] / engine["engine_tokens_per_s"]
    return result


def print_mixed(result: dict[str, Any]) -> None:
    mode = "sampled" if result["sampled"] else "greedy"
    print(f"mixed workload ({result['num_requests']} requests, {mode}): offline "
          f"{result['offline_output_tokens_per_s']:.1f} output tok/s")
    for load in result["loads"]:
        rate = "all at once" if load["rate"] is None else f"Poisson {load['rate']:g} req/s"
        print(f"  {rate:<20} {load['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p99 {load['ttft_p50_ms']:.0f}/"
              f"{load['ttft_p99_ms']:.0f} ms  TPOT p50/p99 {load['tpot_p50_ms']:.0f}/{load['tpot_p99_ms']:.0f} ms"
              f"  errors {load['num_errors']}")
    if "served_offline_ratio" in result:
        print(f"  served / offline (all at once): {result['served_offline_ratio']:.3f}")
