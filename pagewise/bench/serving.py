"""``pagewise bench serving``: concurrent streaming clients against the API, like vLLM's serving benchmark.

Without ``--url`` it starts the real server itself (``pagewise serve`` on a free port with a temporary SQLite
database and a bootstrap admin key it generates and hands over in ``PAGEWISE_ADMIN_KEY``), waits for ``/ready``,
and creates a tenant and an inference key through the admin API. With ``--url`` it drives a running server with
``--api-key`` (or creates a tenant and a key with ``--admin-key``).

Two phases:

1. Load: ``--concurrency`` clients each send streamed ``/v1/chat/completions`` requests back to back (greedy,
   ``ignore_eos`` so every request produces exactly ``--max-tokens`` tokens): ``--num-requests`` in all, or with
   ``--duration`` (closed loop) until the deadline, the requests in flight then finishing and counting. Reports
   request and output token throughput and TTFT / TPOT / ITL / end-to-end latency percentiles, measured by the
   client: TTFT = first content chunk; TPOT = (end-to-end - TTFT) / (output tokens - 1); ITL = gaps between
   content chunks. A non-200 answer, an SSE error event, a transport error or a stream without ``[DONE]`` is
   counted as an error (``num_errors``, the first messages in ``errors``) and the run goes on.
2. Platform overhead: ``--overhead-requests`` pairs of the same ``max_tokens=1`` chat request, one at a time,
   sent through the API (non-streamed) and straight to an ``AsyncLLMEngine`` of this bench with the same model
   and configuration (stepped in a child process, as the server's engine is), alternating. The overhead of a
   pair is the difference of the two wall times (HTTP, auth, quota, persistence, rendering); p50 and p99 over
   the pairs.

``--workload mixed`` runs the throughput workload instead: offline, then served all at once and at each
``--rate`` (see ``served_workload``), reporting the served/offline ratio.

With ``--json`` stdout is one JSON object; progress always goes to stderr (every 5 s during the load). The
exit status is 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from pagewise.bench._common import create_inference_key, latency_summary, percentile, served_model
from pagewise.bench._common import progress as log
from pagewise.bench.distributed import prefix_affinity, queue_hop
from pagewise.bench.local_server import local_server
from pagewise.exit_status import ExitStatus

DEFAULT_NUM_REQUESTS = 32
MIXED_NUM_REQUESTS = 64
MIXED_RATES = [math.inf, 0.75]
DEFAULT_CONCURRENCY = 8
DEFAULT_MAX_TOKENS = 32
DEFAULT_OVERHEAD_REQUESTS = 100  # max_tokens=1 pairs: enough for a steady p50 on a noisy machine
DEFAULT_MAX_MODEL_LEN = 1024
PROGRESS_INTERVAL_S = 5.0
MAX_ERROR_MESSAGES = 5
_TOPICS = (
    "paged attention",
    "continuous batching",
    "prefix caching",
    "copy-on-write",
    "the KV cache",
    "token sampling",
    "rate limiting",
    "multi-tenancy",
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``serving`` to the ``pagewise bench`` subcommands."""
    from pagewise.engine.loader import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "serving", help="streaming clients against the API: throughput, latency, platform overhead"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    parser.add_argument("--url", help="a running server (default: start one on a free port)")
    parser.add_argument("--api-key", default=os.environ.get("PAGEWISE_API_KEY"), help="inference key for --url")
    parser.add_argument("--admin-key", help="with --url and no --api-key: create a tenant and a key with this")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument(
        "--workload",
        choices=("chat", "mixed"),
        default="chat",
        help="chat: the load, overhead and queue-hop phases below; mixed: the throughput workload served (all at "
        "once and at each --rate) against the engine offline on the same requests",
    )
    parser.add_argument(
        "--rate",
        type=float,
        action="append",
        dest="rates",
        metavar="REQ_PER_S",
        help="mixed: a Poisson arrival rate (repeatable; inf = all at once; default: inf and 0.75)",
    )
    parser.add_argument("--sampled", action="store_true", help="mixed: temperature 0.8, top-p 0.95, top-k 50")
    parser.add_argument(
        "--num-requests",
        type=int,
        help=f"without --duration (default: {DEFAULT_NUM_REQUESTS}; mixed: {MIXED_NUM_REQUESTS})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        metavar="SECONDS",
        help="closed loop: each client sends requests back to back until then (default: --num-requests in all)",
    )
    parser.add_argument("--concurrency", type=int, default=DEFAULT_CONCURRENCY)
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument(
        "--overhead-requests",
        type=int,
        default=DEFAULT_OVERHEAD_REQUESTS,
        help="max_tokens=1 pairs (API vs the engine directly); 0 skips the overhead phase",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN, help="for the server this starts and the engine"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=0,
        help="start the distributed stack (API + N pagewise workers on Redis) instead of the embedded server; "
        "adds the queue hop and, with N >= 2, the prefix-affinity comparison",
    )
    parser.set_defaults(func=run)


# ---- results


@dataclass(slots=True)
class LoadPlan:
    """The load phase: `num_requests` requests in all, or with `duration_s` as many as the clients send by then."""

    concurrency: int
    max_tokens: int
    num_requests: int
    duration_s: float | None = None


@dataclass(slots=True)
class RequestResult:
    """One load request as the client saw it (seconds); `error` is set, and nothing else, when it failed."""

    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


# ---- progress (stderr)


class Progress:
    """`label: done/total` on stderr: rewritten in place on a terminal, every quarter otherwise."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self._tty = sys.stderr.isatty()
        self._start = time.perf_counter()
        self._next_line = 0

    def advance(self) -> None:
        self.done += 1
        elapsed = time.perf_counter() - self._start
        line = f"{self.label}: {self.done}/{self.total} ({elapsed:.1f} s)"
        if self._tty:
            print(f"\r{line}", end="\n" if self.done == self.total else "", file=sys.stderr, flush=True)
        elif self.done >= self._next_line or self.done == self.total:
            print(line, file=sys.stderr, flush=True)
            self._next_line = self.done + max(1, self.total // 4)


# ---- the server


@contextmanager
def bench_server(
    model: str, max_model_len: int, workers: int = 0, engine_args: Sequence[str] = ()
) -> Iterator[tuple[str, str]]:
    """Start ``pagewise serve`` on a free port with a fresh SQLite database — or, with ``workers``, the distributed
    stack on it — and yield (base URL, admin key). `engine_args` are more of the engine's flags."""
    from pagewise.bench.distributed import migrated_sqlite
    from pagewise.bench.stack import distributed_stack

    with tempfile.TemporaryDirectory(prefix="pagewise-bench-") as tmp:
        engine_args = ["--model", model, "--max-model-len", str(max_model_len), *engine_args]
        quiet = ["--log-level", "warning"]  # no access log line per request, in either mode
        if workers:
            database_url = migrated_sqlite(Path(tmp))
            with distributed_stack(Path(tmp), database_url, engine_args, workers=workers, serve_args=quiet) as stack:
                yield stack.api.base, stack.api.admin_key
            return
        database_url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
        with local_server(Path(tmp), database_url, [*engine_args, *quiet]) as server:
            yield server.base, server.admin_key


# ---- load phase


def _messages(i: int, tag: str) -> list[dict[str, str]]:
    topic = _TOPICS[i % len(_TOPICS)]
    return [{"role": "user", "content": f"[{tag} {i}] Explain {topic} to a new engineer, step by step."}]


async def stream_one(client: Any, model: str, messages: list[dict[str, str]], max_tokens: int) -> RequestResult:
    """One streamed chat request, timed here. A failure is a result with `error` set, never an exception."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                return RequestResult(error=f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}")
            return await _read_events(response.aiter_lines(), start)
    except Exception as error:  # noqa: BLE001 - a failed request is counted, not fatal
        return RequestResult(error=f"{type(error).__name__}: {error}")


async def _read_events(lines: AsyncIterator[str], start: float) -> RequestResult:
    """Time the content chunks of an SSE stream up to ``[DONE]``; an error event or no ``[DONE]`` is an error."""
    content_at: list[float] = []
    usage_tokens = 0
    async for line in lines:
        if line == "data: [DONE]":
            break
        if not line.startswith("data: "):
            continue
        event = json.loads(line[len("data: ") :])
        if "error" in event:
            return RequestResult(error=f"error event: {event['error'].get('message', event['error'])}")
        if event.get("usage"):
            usage_tokens = event["usage"]["completion_tokens"]
        if any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
            content_at.append(time.perf_counter())
    else:
        return RequestResult(error="the stream ended without [DONE]")
    if not content_at:
        return RequestResult(error="no content")
    return RequestResult(
        ttft=content_at[0] - start,
        e2e=time.perf_counter() - start,
        output_tokens=usage_tokens or len(content_at),
        itl=[later - earlier for earlier, later in pairwise(content_at)],
    )


class _Dispatcher:
    """Hands each client its next request index: `num_requests` in all, or any number until the deadline."""

    def __init__(self, plan: LoadPlan) -> None:
        self.start = time.perf_counter()
        self._limit = None if plan.duration_s else plan.num_requests
        self._deadline = self.start + plan.duration_s if plan.duration_s else math.inf
        self._sent = 0

    def next_index(self) -> int | None:
        if self._sent == self._limit or time.perf_counter() >= self._deadline:
            return None
        self._sent += 1
        return self._sent - 1


async def _report_every(interval_s: float, plan: LoadPlan, results: list[RequestResult], start: float) -> None:
    """A progress line on stderr every `interval_s` until cancelled."""
    while True:
        await asyncio.sleep(interval_s)
        done = f"{len(results)}" if plan.duration_s else f"{len(results)}/{plan.num_requests}"
        elapsed = f"{time.perf_counter() - start:.0f} s" + (f" of {plan.duration_s:g} s" if plan.duration_s else "")
        log(f"load: {done} requests done, {sum(not r.ok for r in results)} errors, {elapsed}")


async def run_load(base: str, key: str, model: str, plan: LoadPlan) -> dict[str, Any]:
    """A warm-up request, then the load: `plan.concurrency` clients, each sending its next request when its last
    one ends, until the dispatcher says stop. Requests in flight at a deadline finish and count."""
    import httpx

    limits = httpx.Limits(max_connections=plan.concurrency + 2, max_keepalive_connections=plan.concurrency + 2)
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=600, limits=limits) as client:
        warm = await stream_one(client, model, _messages(0, "warm-up"), 2)
        if not warm.ok:
            raise RuntimeError(f"warm-up request failed: {warm.error}")
        extent = f"for {plan.duration_s:g} s" if plan.duration_s else f"{plan.num_requests} requests"
        log(f"load: {plan.concurrency} concurrent clients, {plan.max_tokens} tokens each, {extent}")
        results: list[RequestResult] = []
        dispatcher = _Dispatcher(plan)

        async def one_client() -> None:
            while (i := dispatcher.next_index()) is not None:
                results.append(await stream_one(client, model, _messages(i, "load"), plan.max_tokens))

        reporter = asyncio.create_task(_report_every(PROGRESS_INTERVAL_S, plan, results, dispatcher.start))
        try:
            await asyncio.gather(*(one_client() for _ in range(plan.concurrency)))
        finally:
            reporter.cancel()
        duration = time.perf_counter() - dispatcher.start
    return _load_summary(plan, results, duration)


def _load_summary(plan: LoadPlan, results: list[RequestResult], duration: float) -> dict[str, Any]:
    """Counts, throughput and latency percentiles (of the successful requests) for the JSON and the table."""
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    log(f"load: {len(results)} requests, {len(errors)} errors in {duration:.1f} s")
    if errors:
        log(f"first error: {errors[0]}")
    output_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, Any] = {
        "concurrency": plan.concurrency,
        "max_tokens": plan.max_tokens,
        "duration_target_s": plan.duration_s,
        "duration_s": duration,
        "num_requests": len(results),
        "num_completed": len(ok),
        "num_errors": len(errors),
        "errors": errors[:MAX_ERROR_MESSAGES],
        "request_throughput_per_s": len(ok) / duration,
        "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration,
    }
    summary.update(latency_summary("ttft", [r.ttft for r in ok]))
    summary.update(latency_summary("tpot", [r.tpot for r in ok if r.tpot is not None]))
    summary.update(latency_summary("itl", [gap for r in ok for gap in r.itl]))
    summary.update(latency_summary("e2e", [r.e2e for r in ok]))
    return summary


# ---- overhead phase


class _EngineOnItsLoop:
    """An ``AsyncLLMEngine`` of this process, stepped in a child process as the server's is, used from a private
    event loop thread (the bench's own loop stays free for the HTTP client, and neither side's timing includes
    the other's scheduling)."""

    def __init__(self, model: str, max_model_len: int) -> None:
        from pagewise.engine.async_engine import AsyncLLMEngine
        from pagewise.engine.config import EngineConfig

        config = EngineConfig(model=model, max_model_len=max_model_len)
        self.engine = AsyncLLMEngine(config, progress=False, process=True)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-engine-loop", daemon=True)
        self._thread.start()

    def generate_seconds(self, prompt: list[int], request_id: str) -> float:
        """Wall time of one ``max_tokens=1`` greedy request, measured on the engine's loop."""
        from pagewise.engine.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0)

        async def timed() -> float:
            start = time.perf_counter()
            async for _ in self.engine.generate(prompt, params, request_id=request_id):
                pass
            return time.perf_counter() - start

        return asyncio.run_coroutine_threadsafe(timed(), self.loop).result()

    def close(self) -> None:
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


async def run_overhead(base: str, key: str, model: str, engine: _EngineOnItsLoop, pairs: int) -> dict[str, Any]:
    import httpx

    tokenizer = engine.engine.tokenizer
    headers = {"Authorization": f"Bearer {key}"}
    progress = Progress("overhead (API vs the engine directly, max_tokens=1)", pairs)
    api_s: list[float] = []
    direct_s: list[float] = []
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:

        async def through_api(messages: list[dict[str, str]]) -> float:
            body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}
            start = time.perf_counter()
            response = await client.post("/v1/chat/completions", json=body)
            elapsed = time.perf_counter() - start
            if response.status_code != 200:
                raise RuntimeError(f"overhead request failed: HTTP {response.status_code} {response.text[:200]}")
            return elapsed

        def direct(messages: list[dict[str, str]], request_id: str) -> float:
            prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
            return engine.generate_seconds(prompt, request_id)

        for i in range(2):  # warm both paths (connection, caches of the shared chat-template prefix)
            await through_api(_messages(i, "overhead warm-up"))
            await asyncio.to_thread(direct, _messages(i, "overhead warm-up"), f"warm-{i}")
        for i in range(pairs):
            messages = _messages(i, "overhead")  # a prompt new to both engines, identical for both
            if i % 2 == 0:
                api_s.append(await through_api(messages))
                direct_s.append(await asyncio.to_thread(direct, messages, f"overhead-{i}"))
            else:
                direct_s.append(await asyncio.to_thread(direct, messages, f"overhead-{i}"))
                api_s.append(await through_api(messages))
            progress.advance()
    diffs_ms = [(a - d) * 1000 for a, d in zip(api_s, direct_s, strict=True)]
    return {
        "overhead_requests": pairs,
        "overhead_p50_ms": percentile(diffs_ms, 50),
        "overhead_p99_ms": percentile(diffs_ms, 99),
        "overhead_mean_ms": statistics.fmean(diffs_ms),
        "api_max_tokens_1_p50_ms": percentile([s * 1000 for s in api_s], 50),
        "engine_max_tokens_1_p50_ms": percentile([s * 1000 for s in direct_s], 50),
    }


# ---- the command


def _usage_error(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments, if anything."""
    for name in ("num_requests", "concurrency", "max_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    if args.duration is not None and not (math.isfinite(args.duration) and args.duration > 0):
        return f"--duration must be a positive number of seconds, got {args.duration:g}"
    if args.overhead_requests < 0:
        return "--overhead-requests must not be negative"
    if args.workers < 0 or (args.workers and args.url):
        return "--workers must be >= 0, and cannot be combined with --url"
    if args.url and not (args.api_key or args.admin_key):
        return "--url needs --api-key (or PAGEWISE_API_KEY) or --admin-key"
    if args.workload == "chat" and (args.rates or args.sampled):
        return "--rate and --sampled apply to --workload mixed"
    if args.rates and not all(r > 0 for r in args.rates):
        return "--rate must be a positive number of requests per second (inf: all at once)"
    return None


def _run_mixed(args: argparse.Namespace) -> int:
    from pagewise.bench.served_workload import print_mixed, run_mixed

    args.rates = args.rates or MIXED_RATES
    started = time.perf_counter()
    try:
        result = run_mixed(args, _server(args))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.FAILED
    result.update(url=args.url or "local", workers=args.workers, bench_seconds=time.perf_counter() - started)
    if args.json:
        print(json.dumps(result))
    else:
        print_mixed(result)
    return ExitStatus.OK if result["num_errors"] == 0 else ExitStatus.FAILED


def run(args: argparse.Namespace) -> int:
    if args.num_requests is None:
        args.num_requests = MIXED_NUM_REQUESTS if args.workload == "mixed" else DEFAULT_NUM_REQUESTS
    if problem := _usage_error(args):
        print(f"error: {problem}", file=sys.stderr)
        return ExitStatus.STARTUP_ERROR
    if args.workload == "mixed":
        return _run_mixed(args)
    plan = LoadPlan(args.concurrency, args.max_tokens, args.num_requests, args.duration)
    started = time.perf_counter()
    engine: _EngineOnItsLoop | None = None
    if args.overhead_requests:
        # Loaded before the server starts, so the two loads do not compete for the cores.
        log(f"loading {args.model} in an engine of this bench (the overhead baseline)")
        engine = _EngineOnItsLoop(args.model, args.max_model_len)
    try:
        with _server(args) as (base, key, admin_key):
            model = served_model(base, key, args.model)
            load = asyncio.run(run_load(base, key, model, plan))
            result: dict[str, Any] = {"url": args.url or "local", "model": model, **load}
            if engine is not None:
                result.update(asyncio.run(run_overhead(base, key, model, engine, args.overhead_requests)))
            result.update(asyncio.run(queue_hop(base, key, model, metrics_key=admin_key)))
        result["workers"] = args.workers
        if args.workers >= 2:
            with tempfile.TemporaryDirectory(prefix="pagewise-bench-affinity-") as tmp:
                engine_args = ["--model", args.model, "--max-model-len", str(args.max_model_len)]
                result.update(prefix_affinity(Path(tmp), engine_args, args.workers, model))
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.FAILED
    finally:
        if engine is not None:
            engine.close()
    result["bench_seconds"] = time.perf_counter() - started
    if args.json:
        print(json.dumps(result))
    else:
        _print_table(result)
    return ExitStatus.OK if result["num_errors"] == 0 else ExitStatus.FAILED


@contextmanager
def _server(args: argparse.Namespace) -> Iterator[tuple[str, str, str | None]]:
    """(base URL, inference key, admin key if known): the given server, or one started here."""
    if args.url:
        base = args.url.rstrip("/")
        yield base, args.api_key or create_inference_key(base, args.admin_key), args.admin_key
        return
    where = f"with {args.workers} workers" if args.workers else "embedded"
    log(f"starting pagewise serve {where} ({args.model}, max_model_len {args.max_model_len})")
    with bench_server(args.model, args.max_model_len, args.workers) as (base, admin_key):
        log(f"server ready at {base}")
        yield base, create_inference_key(base, admin_key), admin_key


def _print_table(result: dict[str, Any]) -> None:
    rows = [
        ("requests completed / errors", f"{result['num_completed']} / {result['num_errors']}"),
        ("concurrency, max_tokens", f"{result['concurrency']}, {result['max_tokens']}"),
        ("duration", f"{result['duration_s']:.2f} s" + _target(result["duration_target_s"])),
        ("request throughput", f"{result['request_throughput_per_s']:.2f} req/s"),
        ("output token throughput", f"{result['output_tokens_per_s']:.1f} tok/s"),
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        values = ", ".join(f"p{q} {result[f'{name}_p{q}_ms']:.1f}" for q in (50, 90, 99))
        rows.append((f"{name.upper()} (ms)", f"mean {result[f'{name}_mean_ms']:.1f}, {values}"))
    if "queue_hop_p50_ms" in result:
        rows.append(("queue hop (ms)", f"p50 {result['queue_hop_p50_ms']:.2f}, p99 {result['queue_hop_p99_ms']:.2f}"))
    if "cached_token_ratio" in result:
        rows.append(
            (
                f"cached tokens, {result['workers']} workers / 1",
                f"{result['cached_token_ratio']:.3f} with affinity, {result['cached_token_ratio_blind']:.3f} blind",
            )
        )
    if "overhead_p50_ms" in result:
        rows.append(
            (
                "platform overhead (ms)",
                f"p50 {result['overhead_p50_ms']:.2f}, p99 {result['overhead_p99_ms']:.2f} "
                f"(API {result['api_max_tokens_1_p50_ms']:.1f} vs engine {result['engine_max_tokens_1_p50_ms']:.1f}"
                f" p50, {result['overhead_requests']} pairs)",
            )
        )
    width = max(len(name) for name, _ in rows)
    print(f"serving benchmark: {result['model']} at {result['url']}")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


def _target(duration_target_s: float | None) -> str:
    return f" (closed loop for {duration_target_s:g} s)" if duration_target_s else ""
