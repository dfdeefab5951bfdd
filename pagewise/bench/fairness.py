"""``pagewise bench fairness``: one tenant's flood must not become another tenant's outage.

Two tenants share an ``AsyncLLMEngine`` (``--model``, ``--max-model-len`` 1,024, other engine defaults) whose
engine core runs in a child process, as ``pagewise serve``'s does (``--in-process``: on a thread of the bench's
process, where the bench's own event loop competes with the engine for the GIL). The flood tenant keeps
``--flood-streams`` closed-loop streams busy: each sends a random-token prompt of U[``--flood-prompt-tokens``]
tokens for ``--flood-max-tokens`` tokens (greedy, ``ignore_eos``) and its next one when it ends. The quiet tenant
sends a ``--quiet-prompt-tokens`` prompt for ``--quiet-max-tokens`` tokens every ``--quiet-interval`` seconds, open
loop: a new one on schedule even while the last one runs. Every prompt is distinct (seeded by ``--seed``), so the
prefix cache never hits.

Three engines, loaded one after the other: ``fair`` (the fair policy with step interrupts, the default), ``fcfs``
and ``fair_no_interrupts`` (``enable_step_interrupts=False``); every phase runs ``--warmup`` seconds unmeasured,
then ``--duration`` seconds measured:

- ``solo``: the quiet tenant alone on the fair engine — the baseline; ``solo_fcfs`` repeats it on the FCFS engine
  (alone, the policy should make no difference);
- ``flooded_fair``, ``flooded_fcfs``, ``flooded_fair_no_interrupts``: both tenants, at one priority;
- ``flooded_priority``: on the FCFS engine, the flood at priority 1 (the ``batch`` class) and the quiet tenant at
  0 (``interactive``): what priority classes alone give.

A quiet request's TTFT is the time from its ``generate`` call to its first delta with tokens; every quiet request
sent inside the window counts, and the flood goes on until the window is over and the last of them has finished.
Output tokens/s counts both tenants' tokens delivered inside the window; processed tokens/s adds the prompt
positions the engine reached (its ``stats()`` counters: billed once, prefix hits included, recomputes not
counted again), a steadier measure of the work done while the flood's
requests are mostly in prefill. The figures: ``ttft_p99_ratio_fcfs`` and ``ttft_p99_ratio_fair`` = the flooded
phase's quiet p99 / the solo p99 (fair target <= 1.5), ``throughput_ratio`` = fair / FCFS output tokens/s under
the flood, ``processed_throughput_ratio`` likewise for processed tokens/s (target >= 0.95), each phase's raw
figures, and the fair engine's per-tenant ``served`` counters (the latest ``stats()["tenants"]`` entries seen
during the flood; FCFS keeps none). ``ttft_p99_ratio_priority`` is ``flooded_priority``'s p99 / ``solo_fcfs``'s.
Each phase reports the flood's TPOT (per flood request finished inside the window: from its first token to its
last, per token after the first) and the engine's step interrupts per second of the window. ``--quick`` shrinks
every default so a test runs it in seconds; a flag given explicitly wins over both.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import math
import random
import sys
import time
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from pagewise.bench._common import Timer, add_model_arg, latency_summary, print_table, progress, random_tokens
from pagewise.exit_status import ExitStatus

FLOOD, QUIET = "flood", "quiet"
POLICIES = ("fair", "fcfs")
BATCH_PRIORITY = 1  # the flood's class in the priority phase; the quiet tenant stays at 0 (interactive)
# engine name -> (scheduling policy, step interrupts on, its phases as (name, flooded, flood priority))
ENGINES: dict[str, tuple[str, bool, tuple[tuple[str, bool, int], ...]]] = {
    "fair": ("fair", True, (("solo", False, 0), ("flooded_fair", True, 0))),
    "fcfs": (
        "fcfs",
        True,
        (("solo_fcfs", False, 0), ("flooded_fcfs", True, 0), ("flooded_priority", True, BATCH_PRIORITY)),
    ),
    "fair_no_interrupts": ("fair", False, (("flooded_fair_no_interrupts", True, 0),)),
}
TARGET_TTFT_P99_RATIO_FAIR_MAX = 1.5
TARGET_THROUGHPUT_RATIO_MIN = 0.95
_IDLE_TIMEOUT_S = 60.0
_WATCH_INTERVAL_S = 0.1
# flag -> (full default, --quick default)
_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "flood_streams": (40, 6),
    "flood_prompt_tokens": ((256, 512), (64, 128)),
    "flood_max_tokens": (32, 8),
    "quiet_prompt_tokens": (32, 16),
    "quiet_max_tokens": (4, 2),
    "quiet_interval": (1.0, 0.5),
    "duration": (30.0, 3.0),
    "warmup": (3.0, 2.0),
    "engine_warmup": (20.0, 0.0),
}


@dataclass(slots=True, frozen=True)
class Workload:
    """Both tenants' traffic; the same for every phase (a solo phase has no flood)."""

    flood_streams: int
    flood_prompt_tokens: tuple[int, int]
    flood_max_tokens: int
    quiet_prompt_tokens: int
    quiet_max_tokens: int
    quiet_interval_s: float
    duration_s: float
    warmup_s: float
    seed: int
    engine_warmup_s: float = 0.0


@dataclass(slots=True)
class Window:
    """The measured window of a phase: output tokens delivered inside it, by tenant, and the quiet TTFTs."""

    start: float
    end: float
    output_tokens: dict[str, int] = field(default_factory=lambda: {FLOOD: 0, QUIET: 0})
    flood_requests_finished: int = 0
    quiet_ttft_s: list[float] = field(default_factory=list)
    flood_tpot_s: list[float] = field(default_factory=list)
    step_interrupts: int = 0
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)  # each tenant's latest counters seen
    processed_tokens: int = 0  # prompt positions reached plus tokens generated by the engine, both tenants

    def count(self, tenant: str, output) -> None:
        if self.start <= time.perf_counter() <= self.end:
            self.output_tokens[tenant] += sum(len(c.token_ids) for c in output.outputs)
            if tenant == FLOOD and output.finished:
                self.flood_requests_finished += 1


# ---- one phase


async def _flood_stream(
    engine, prompts: random.Random, workload: Workload, window: Window, priority: int
) -> None:
    """One closed-loop flood stream: a request, then the next when it ends, until cancelled."""
    from pagewise.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=workload.flood_max_tokens, temperature=0, ignore_eos=True)
    vocab = engine.limits.vocab_size
    while True:
        prompt = random_tokens(prompts.randint(*workload.flood_prompt_tokens), vocab, prompts)
        first_at, tokens = None, 0
        async with aclosing(engine.generate(prompt, params, tenant_id=FLOOD, priority=priority)) as stream:
            async for output in stream:
                window.count(FLOOD, output)
                new = sum(len(c.token_ids) for c in output.outputs)
                if new and first_at is None:
                    first_at, tokens = time.perf_counter(), new - 1
                elif new:
                    tokens += new
        now = time.perf_counter()
        if first_at is not None and tokens > 0 and window.start <= now <= window.end:
            window.flood_tpot_s.append((now - first_at) / tokens)


async def _quiet_request(engine, prompt: list[int], workload: Workload, window: Window, measured: bool) -> None:
    from pagewise.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=workload.quiet_max_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    first = True
    async with aclosing(engine.generate(prompt, params, tenant_id=QUIET)) as stream:
        async for output in stream:
            if first and output.outputs and output.outputs[0].token_ids:
                first = False
                if measured:
                    window.quiet_ttft_s.append(time.perf_counter() - start)
            window.count(QUIET, output)
    if first:
        raise RuntimeError("a quiet request finished without a token")


async def _quiet_sender(engine, prompts: random.Random, workload: Workload, window: Window, begin: float) -> None:
    """Open loop: a quiet request every interval from ``begin`` to the window's end; returns once every request
    sent has finished (those sent before the window are not measured)."""
    vocab = engine.limits.vocab_size
    requests = []
    for k in range(math.ceil((window.end - begin) / workload.quiet_interval_s)):
        send_at = begin + k * workload.quiet_interval_s
        await asyncio.sleep(max(0.0, send_at - time.perf_counter()))
        prompt = random_tokens(workload.quiet_prompt_tokens, vocab, prompts)
        measured = send_at >= window.start
        requests.append(asyncio.create_task(_quiet_request(engine, prompt, workload, window, measured)))
    await asyncio.gather(*requests)


async def _count_processed(engine, window: Window) -> None:
    """The engine's reached prompt positions plus generated tokens between the window's ends (each read from
    the snapshot of the latest finished step)."""

    async def counters_at(moment: float) -> tuple[int, int]:
        await asyncio.sleep(max(0.0, moment - time.perf_counter()))
        stats = engine.stats()
        return stats["prompt_tokens_total"] + stats["generation_tokens_total"], stats["step_interrupts"]

    processed, interrupts = await counters_at(window.start)
    processed_end, interrupts_end = await counters_at(window.end)
    window.processed_tokens = processed_end - processed
    window.step_interrupts = interrupts_end - interrupts


async def _watch_tenants(engine, window: Window) -> None:
    """Keep each tenant's latest ``stats()["tenants"]`` entry (the engine lists only active tenants) until
    cancelled."""
    while True:
        window.tenants.update(engine.stats()["tenants"])
        await asyncio.sleep(_WATCH_INTERVAL_S)


async def _wait_idle(engine) -> None:
    deadline = time.perf_counter() + _IDLE_TIMEOUT_S
    while (stats := engine.stats())["num_requests_running"] + stats["num_requests_waiting"] > 0:
        if time.perf_counter() > deadline:
            raise RuntimeError(f"the engine still had requests {_IDLE_TIMEOUT_S:g} s after a phase")
        await asyncio.sleep(0.05)


async def run_phase(
    engine, workload: Workload, name: str, flooded: bool, flood_priority: int = 0
) -> dict[str, Any]:
    """Warm-up, then the measured window; the flood is stopped (its requests aborted) once the window is over and
    every quiet request has finished, and the phase returns with the engine idle."""
    seed = f"{workload.seed}:{'flooded' if flooded else 'solo'}"  # equal traffic under both policies
    flood_prompts, quiet_prompts = random.Random(f"{seed}:{FLOOD}"), random.Random(f"{seed}:{QUIET}")
    begin = time.perf_counter()
    window = Window(begin + workload.warmup_s, begin + workload.warmup_s + workload.duration_s)
    streams = workload.flood_streams if flooded else 0
    flood = [
        asyncio.create_task(_flood_stream(engine, flood_prompts, workload, window, flood_priority))
        for _ in range(streams)
    ]
    background = [*flood, asyncio.create_task(_watch_tenants(engine, window))]
    try:
        await asyncio.gather(
            _quiet_sender(engine, quiet_prompts, workload, window, begin), _count_processed(engine, window)
        )
        for task in flood:
            if task.done():  # a flood stream that failed: surface its error
                task.result()
    finally:
        for task in background:
            task.cancel()
        await asyncio.gather(*background, return_exceptions=True)
    overrun_s = max(0.0, time.perf_counter() - window.end)
    await _wait_idle(engine)
    result = _phase_figures(name, engine.config, flooded, flood_priority, window)
    progress(
        f"{name}: {len(window.quiet_ttft_s)} quiet requests, TTFT p50 {result['quiet_ttft_p50_ms']:.0f} ms,"
        f" p99 {result['quiet_ttft_p99_ms']:.0f} ms; {result['output_tokens_per_s']:.1f} output tok/s;"
        f" the last quiet request ended {overrun_s:.1f} s after the window"
    )
    return result


def _phase_figures(name: str, config, flooded: bool, flood_priority: int, window: Window) -> dict[str, Any]:
    ttft_ms = [s * 1000 for s in window.quiet_ttft_s]
    if not ttft_ms:
        raise RuntimeError(f"phase {name}: no quiet request was measured; raise --duration or lower --quiet-interval")
    duration = window.end - window.start
    tokens = window.output_tokens
    figures: dict[str, Any] = {
        "policy": config.scheduling_policy,
        "step_interrupts": config.enable_step_interrupts,
        "flooded": flooded,
        "flood_priority": flood_priority,
        "duration_s": duration,
        "quiet_requests": len(ttft_ms),
        **latency_summary("quiet_ttft", window.quiet_ttft_s),
    }
    figures["quiet_ttft_max_ms"] = max(ttft_ms)
    figures.update(
        {
            "flood_requests_finished": window.flood_requests_finished,
            "output_tokens": tokens[FLOOD] + tokens[QUIET],
            "output_tokens_per_s": (tokens[FLOOD] + tokens[QUIET]) / duration,
            "flood_output_tokens_per_s": tokens[FLOOD] / duration,
            "quiet_output_tokens_per_s": tokens[QUIET] / duration,
            "processed_tokens_per_s": window.processed_tokens / duration,
            "interrupts_per_s": window.step_interrupts / duration,
            **latency_summary("flood_tpot", window.flood_tpot_s),
            "tenants": window.tenants,
        }
    )
    return figures


# ---- the command


def _engine(args: argparse.Namespace, policy: str, interrupts: bool):
    from pagewise.engine.async_engine import AsyncLLMEngine
    from pagewise.engine.config import EngineConfig

    config = EngineConfig(
        model=args.model,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens,
        fair_max_num_batched_tokens=args.fair_max_num_batched_tokens,
        scheduling_policy=policy,
        enable_step_interrupts=interrupts,
    )
    return AsyncLLMEngine(config, progress=False, process=not args.in_process)


async def _phases(engine, workload: Workload, phases: tuple[tuple[str, bool, int], ...]) -> dict[str, dict[str, Any]]:
    """The engine's phases, after an unmeasured flood (``--engine-warmup`` seconds): a fresh engine computes its
    first floods slower (in the runs of 2026-12-05, an engine's second flooded phase processed 30-60% more tokens
    per second than its first), so every engine starts its measured phases warm."""
    if workload.engine_warmup_s > 0:
        warm = dataclasses.replace(workload, warmup_s=0.0, duration_s=workload.engine_warmup_s)
        await run_phase(engine, warm, "engine warm-up", flooded=True)
    return {name: await run_phase(engine, workload, name, flooded, priority) for name, flooded, priority in phases}


def _resolve(args: argparse.Namespace) -> Workload:
    """The workload: each flag as given, else its full or ``--quick`` default."""
    values = {name: getattr(args, name) for name in _DEFAULTS}
    for name, (full, quick) in _DEFAULTS.items():
        if values[name] is None:
            values[name] = quick if args.quick else full
    return Workload(
        flood_streams=values["flood_streams"],
        flood_prompt_tokens=tuple(values["flood_prompt_tokens"]),
        flood_max_tokens=values["flood_max_tokens"],
        quiet_prompt_tokens=values["quiet_prompt_tokens"],
        quiet_max_tokens=values["quiet_max_tokens"],
        quiet_interval_s=values["quiet_interval"],
        duration_s=values["duration"],
        warmup_s=values["warmup"],
        seed=args.seed,
        engine_warmup_s=values["engine_warmup"],
    )


def _usage_error(workload: Workload, max_model_len: int) -> str | None:
    """What is wrong with the workload, if anything."""
    low, high = workload.flood_prompt_tokens
    for flag, value in (
        ("--flood-streams", workload.flood_streams),
        ("--flood-max-tokens", workload.flood_max_tokens),
        ("--quiet-prompt-tokens", workload.quiet_prompt_tokens),
        ("--quiet-max-tokens", workload.quiet_max_tokens),
        ("--flood-prompt-tokens MIN", low),
    ):
        if value < 1:
            return f"{flag} must be at least 1, got {value}"
    if high < low:
        return f"--flood-prompt-tokens MIN MAX: MAX ({high}) is smaller than MIN ({low})"
    for flag, seconds in (("--quiet-interval", workload.quiet_interval_s), ("--duration", workload.duration_s)):
        if not (math.isfinite(seconds) and seconds > 0):
            return f"{flag} must be a positive number of seconds, got {seconds:g}"
    for flag, seconds in (("--warmup", workload.warmup_s), ("--engine-warmup", workload.engine_warmup_s)):
        if not (math.isfinite(seconds) and seconds >= 0):
            return f"{flag} must be a number of seconds >= 0, got {seconds:g}"
    for what, total in (
        ("flood", high + workload.flood_max_tokens),
        ("quiet", workload.quiet_prompt_tokens + workload.quiet_max_tokens),
    ):
        if total > max_model_len:
            return f"a {what} request needs {total:,} tokens; --max-model-len is {max_model_len:,}"
    return None


def run(args: argparse.Namespace) -> int:
    workload = _resolve(args)
    if problem := _usage_error(workload, args.max_model_len):
        print(f"error: {problem}", file=sys.stderr)
        return ExitStatus.STARTUP_ERROR
    clock = Timer()
    phases: dict[str, dict[str, Any]] = {}
    model = args.model
    for name, (policy, interrupts, engine_phases) in ENGINES.items():
        progress(f"loading {args.model} for the {name} engine, {clock}")
        engine = _engine(args, policy, interrupts)
        model = engine.model_name
        try:
            phases.update(asyncio.run(_phases(engine, workload, engine_phases)))
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return ExitStatus.FAILED
        finally:
            engine.shutdown()
            del engine
            gc.collect()  # one engine's weights and KV cache at a time
    result = _result(model, args, workload, phases)
    result["bench_seconds"] = time.perf_counter() - clock.start
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return ExitStatus.OK


def _result(
    model: str, args: argparse.Namespace, workload: Workload, phases: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    solo_p99 = phases["solo"]["quiet_ttft_p99_ms"]
    fcfs, fair = phases["flooded_fcfs"], phases["flooded_fair"]
    without = phases["flooded_fair_no_interrupts"]
    ratio_fair = fair["quiet_ttft_p99_ms"] / solo_p99
    throughput_ratio = fair["output_tokens_per_s"] / fcfs["output_tokens_per_s"]
    processed_ratio = fair["processed_tokens_per_s"] / fcfs["processed_tokens_per_s"]
    ratio_priority = phases["flooded_priority"]["quiet_ttft_p99_ms"] / phases["solo_fcfs"]["quiet_ttft_p99_ms"]
    return {
        "model": model,
        "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "fair_max_num_batched_tokens": args.fair_max_num_batched_tokens,
        "engine_process": not args.in_process,
        "workload": dataclasses.asdict(workload),
        "phases": phases,
        "ttft_p99_ratio_fcfs": fcfs["quiet_ttft_p99_ms"] / solo_p99,
        "ttft_p99_ratio_fair": ratio_fair,
        "ttft_p99_ratio_fair_no_interrupts": without["quiet_ttft_p99_ms"] / solo_p99,
        "ttft_p99_ratio_priority": ratio_priority,
        "throughput_ratio": throughput_ratio,
        "processed_throughput_ratio": processed_ratio,
        "processed_throughput_ratio_no_interrupts": without["processed_tokens_per_s"] / fcfs["processed_tokens_per_s"],
        "flood_tpot_p99_ms": {"interrupts": fair["flood_tpot_p99_ms"], "no_interrupts": without["flood_tpot_p99_ms"]},
        "solo_ttft_p99_ratio_fcfs_to_fair": phases["solo_fcfs"]["quiet_ttft_p99_ms"] / solo_p99,
        "served": {  # virtual token counters (empty under FCFS, which keeps none)
            policy: {tenant: state["served"] for tenant, state in phases[f"flooded_{policy}"]["tenants"].items()}
            for policy in POLICIES
        },
        "target_processed_throughput_ratio_min": TARGET_THROUGHPUT_RATIO_MIN,
        "target_ttft_p99_ratio_fair_max": TARGET_TTFT_P99_RATIO_FAIR_MAX,
        "target_throughput_ratio_min": TARGET_THROUGHPUT_RATIO_MIN,
        "meets_targets": ratio_fair <= TARGET_TTFT_P99_RATIO_FAIR_MAX
        and ratio_priority <= TARGET_TTFT_P99_RATIO_FAIR_MAX
        and processed_ratio >= TARGET_THROUGHPUT_RATIO_MIN,
    }


def _print_table(result: dict[str, Any]) -> None:
    rows: list[tuple[str, object]] = []
    for name, phase in result["phases"].items():
        ttft = " / ".join(f"{phase[f'quiet_ttft_p{q}_ms']:.0f}" for q in (50, 90, 99))
        rows.append((f"{name}: quiet TTFT p50 / p90 / p99 ms ({phase['quiet_requests']} requests)", ttft))
        rows.append((f"{name}: output tok/s (flood + quiet)", phase["output_tokens_per_s"]))
        rows.append((f"{name}: processed tok/s (prompt + output)", phase["processed_tokens_per_s"]))
        if phase["flooded"]:
            tpot = f"{phase['flood_tpot_p50_ms']:.0f} / {phase['flood_tpot_p99_ms']:.0f}"
            rows.append((f"{name}: flood TPOT p50 / p99 ms", tpot))
            rows.append((f"{name}: step interrupts per s", phase["interrupts_per_s"]))
    rows += [
        ("ttft_p99_ratio_fcfs (flooded FCFS / solo)", result["ttft_p99_ratio_fcfs"]),
        (
            f"ttft_p99_ratio_fair (flooded fair / solo, <= {TARGET_TTFT_P99_RATIO_FAIR_MAX})",
            result["ttft_p99_ratio_fair"],
        ),
        (f"throughput_ratio (fair / FCFS, >= {TARGET_THROUGHPUT_RATIO_MIN})", result["throughput_ratio"]),
        (
            f"processed_throughput_ratio (fair / FCFS, >= {TARGET_THROUGHPUT_RATIO_MIN})",
            result["processed_throughput_ratio"],
        ),
        ("ttft_p99_ratio_fair_no_interrupts", result["ttft_p99_ratio_fair_no_interrupts"]),
        (
            f"ttft_p99_ratio_priority (batch-class flood / solo FCFS, <= {TARGET_TTFT_P99_RATIO_FAIR_MAX})",
            result["ttft_p99_ratio_priority"],
        ),
        ("solo p99 FCFS / fair (~1.0)", result["solo_ttft_p99_ratio_fcfs_to_fair"]),
    ]
    for policy, served in result["served"].items():
        for tenant, value in served.items():
            rows.append((f"flooded_{policy}: {tenant} tenant's served counter", float(value)))
    print_table(rows)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``fairness`` to the ``pagewise bench`` subcommands."""
    parser = subparsers.add_parser(
        "fairness",
        help="a quiet tenant's TTFT while another tenant floods the engine: FCFS, fair, step interrupts, priorities",
    )
    add_model_arg(parser)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, help="the step's token budget (engine default)")
    parser.add_argument(
        "--fair-max-num-batched-tokens",
        type=int,
        help="fair engines: the step budget while both tenants are active (engine default: the full budget)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--in-process", action="store_true", help="step the engines on a thread of this process, not in a child"
    )

    def knob(flag: str, help_text: str, **kwargs: Any) -> None:
        full, quick = _DEFAULTS[flag.removeprefix("--").replace("-", "_")]
        shown = " ".join(map(str, full)) if isinstance(full, tuple) else full
        shown_quick = " ".join(map(str, quick)) if isinstance(quick, tuple) else quick
        parser.add_argument(flag, help=f"{help_text} (default {shown}; --quick {shown_quick})", **kwargs)

    knob("--flood-streams", "closed-loop streams of the flood tenant", type=int)
    knob(
        "--flood-prompt-tokens", "flood prompt length, uniform in [MIN, MAX]", type=int, nargs=2, metavar=("MIN", "MAX")
    )
    knob("--flood-max-tokens", "output tokens per flood request", type=int)
    knob("--quiet-prompt-tokens", "quiet prompt length", type=int)
    knob("--quiet-max-tokens", "output tokens per quiet request", type=int)
    knob("--quiet-interval", "seconds between quiet requests (open loop)", type=float, metavar="SECONDS")
    knob("--duration", "measured seconds per phase", type=float, metavar="SECONDS")
    knob("--warmup", "unmeasured seconds before each phase's window", type=float, metavar="SECONDS")
    knob("--engine-warmup", "unmeasured seconds of flood on each engine before its phases", type=float,
         metavar="SECONDS")
    parser.set_defaults(func=run)


__all__ = ["Workload", "register", "run", "run_phase"]
