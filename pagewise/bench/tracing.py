"""``pagewise bench tracing``: serving throughput with tracing off and on (exporting over OTLP/HTTP), side by side.

The workload is ``pagewise bench throughput``'s (``--num-requests`` requests with random prompts of U[32, 512]
tokens and U[16, 256] output tokens, greedy, ``ignore_eos``; ``--quick``: 8 requests, U[32, 128], U[8, 32]), all
submitted at once. It runs where the spans are made — the offline ``LLM`` makes none: the engine side of serving,
``EngineHost`` over an in-process ``AsyncLLMEngine``, the code ``pagewise worker`` runs (one ``Execution`` per
request, its row in a temporary SQLite database, its quota in the in-process store).

- Tracing off: no provider, as with no ``OTEL_*`` variable set: every span is OpenTelemetry's no-op.
- Tracing on: what ``OTEL_EXPORTER_OTLP_ENDPOINT`` sets up in a worker (the production sampler, a batch span
  processor, the OTLP/HTTP protobuf exporter, SQL statements as spans, quota spans), exporting to a receiver this
  bench runs in-process: a threaded HTTP server that accepts and counts ``POST /v1/traces``. A round's time
  includes flushing its spans; the receiver's own work shares the CPU, as a collector on the host would.

One unmeasured warm-up round of each mode, then ``--pairs`` pairs alternating off/on/on/off/…, each round the
whole workload for a tenant of its own (so the prefix cache never carries over). The ratio is the on-rounds'
output tokens/s over the off-rounds' (target >= 0.97). Progress goes to stderr; ``--json`` prints one object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagewise.bench._common import print_table, progress
from pagewise.bench.otlp_receiver import otlp_receiver
from pagewise.bench.throughput import Workload, make_workload
from pagewise.exit_status import ExitStatus

if TYPE_CHECKING:
    from pagewise.engine.async_engine import AsyncLLMEngine
    from pagewise.serving.protocol import Submit

TARGET_RATIO_MIN = 0.97
OFF, ON = "off", "on"


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("tracing", help="serving throughput with tracing off vs on (OTLP/HTTP export)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF directory or GGUF file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small workload and one pair, for smoke tests")
    parser.add_argument("--num-requests", type=int, help="requests per round (default: 64; --quick: 8)")
    parser.add_argument("--pairs", type=int, help="measured off/on pairs (default: 2; --quick: 1)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, help="the step's token budget (default: the engine's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


# ---- the serving side


class _Serving:
    """One engine, one database and one quota store; a host for each mode, so the on-mode's quota spans exist."""

    def __init__(self, engine: AsyncLLMEngine, database_url: str, endpoint: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        from pagewise.platform.db.database import Database
        from pagewise.platform.db.session import create_db_engine
        from pagewise.platform.quotas.memory_store import InProcessQuotaStore
        from pagewise.platform.requests.store import RequestStore
        from pagewise.platform.tracing import TracedQuotaStore
        from pagewise.serving.host import EngineHost
        from pagewise.tracing_export import build_provider

        self.engine = engine
        self.db = Database(create_db_engine(database_url))
        self.sessionmaker = self.db.sessionmaker
        self.quotas = InProcessQuotaStore()
        requests = RequestStore(self.db)
        self.hosts = {
            OFF: EngineHost(engine, requests, self.quotas),
            ON: EngineHost(engine, requests, TracedQuotaStore(self.quotas)),
        }
        self.provider = build_provider("pagewise-bench")
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))

    @contextmanager
    def tracing(self, mode: str) -> Iterator[None]:
        """Tracing as `mode` says while open; off again afterwards."""
        from pagewise import tracing
        from pagewise.platform.tracing import traced_database

        tracing.use(self.provider if mode == ON else None)
        try:
            with traced_database(self.db):
                yield
        finally:
            tracing.use(None)

    async def submits(self, workload: Workload, label: str) -> list[Submit]:
        """The workload as Submits of a new tenant, their rows queued and their quota reserved."""
        from pagewise.engine.sampling_params import SamplingParams
        from pagewise.platform.db.models import RequestRecord
        from pagewise.platform.quotas.quota_store import QuotaLimits
        from pagewise.platform.tenants.schemas import TenantCreate
        from pagewise.platform.tenants.service import TenantService
        from pagewise.serving.protocol import Submit

        async with self.sessionmaker() as session:
            tenant = await TenantService(session).create(TenantCreate(name=f"bench-{label}-{secrets.token_hex(3)}"))
        submits = []
        async with self.sessionmaker() as session:
            for i, (prompt, max_tokens) in enumerate(zip(workload.prompts, workload.output_lens, strict=True)):
                request_id = f"req_{label}_{i}_{secrets.token_hex(4)}"
                params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                decision = await self.quotas.reserve(tenant.id, QuotaLimits(), len(prompt) + max_tokens, request_id)
                row = RequestRecord(
                    id=request_id,
                    tenant_id=tenant.id,
                    endpoint="completions",
                    model=self.engine.model_name,
                    input={"prompt": f"{len(prompt)} random tokens"},
                    params={"max_tokens": max_tokens},
                )
                session.add(row)
                submit = Submit(
                    request_id=request_id,
                    tenant_id=tenant.id,
                    model=self.engine.model_name,
                    endpoint="completions",
                    prompts=[prompt],
                    params=params,
                    reservation=decision.reservation,
                )
                submits.append(submit)
            await session.commit()
        return submits

    async def run_round(self, mode: str, workload: Workload, label: str) -> dict[str, Any]:
        """Run the workload once in `mode`; its output tokens/s (spans flushed to the receiver within the time)."""
        from pagewise.serving.protocol import Event, Finished

        submits = await self.submits(workload, label)
        host = self.hosts[mode]

        async def emit(_: Event) -> None:  # the transport's delivery is not what is measured
            return None

        with self.tracing(mode):
            start = time.perf_counter()
            events = await asyncio.gather(*(host.run(submit, emit) for submit in submits))
            if mode == ON:
                await asyncio.to_thread(self.provider.force_flush)
            seconds = time.perf_counter() - start
        produced = sum(e.usage.completion_tokens for e in events if isinstance(e, Finished) and e.status == "completed")
        if produced != workload.num_output_tokens:
            raise RuntimeError(f"round {label} produced {produced} tokens, expected {workload.num_output_tokens}")
        return {"tracing": mode, "seconds": seconds, "output_tokens_per_s": produced / seconds}

    async def close(self) -> None:
        for host in self.hosts.values():
            await host.drain()
        self.provider.shutdown()
        await self.db.dispose()


def alternating(pairs: int) -> list[str]:
    """off, on, on, off, off, on, …: each mode runs first in half the pairs, so a drift favours neither."""
    return [mode for i in range(pairs) for mode in ((OFF, ON) if i % 2 == 0 else (ON, OFF))]


async def _bench(
    args: argparse.Namespace, workload: Workload, engine: AsyncLLMEngine, database_url: str
) -> dict[str, Any]:
    with otlp_receiver() as received:
        serving = _Serving(engine, database_url, received.traces_url)
        for host in serving.hosts.values():
            host.start()
        try:
            for mode in (OFF, ON):
                warm = await serving.run_round(mode, workload, f"warm-{mode}")
                progress(f"warm-up, tracing {mode}: {warm['output_tokens_per_s']:.1f} output tok/s")
            rounds = []
            for i, mode in enumerate(alternating(args.pairs)):
                rounds.append(await serving.run_round(mode, workload, f"{i}-{mode}"))
                progress(f"round {i + 1}, tracing {mode}: {rounds[-1]['output_tokens_per_s']:.1f} output tok/s")
        finally:
            await serving.close()
        exported = received.summary()
    rate = {
        mode: workload.num_output_tokens * sum(r["tracing"] == mode for r in rounds)
        / sum(r["seconds"] for r in rounds if r["tracing"] == mode)
        for mode in (OFF, ON)
    }
    ratio = rate[ON] / rate[OFF]
    return {
        "model": engine.model_name,
        "num_requests": len(workload.prompts),
        "num_prompt_tokens": workload.num_prompt_tokens,
        "num_output_tokens": workload.num_output_tokens,
        "pairs": args.pairs,
        "rounds": rounds,
        "off_output_tokens_per_s": rate[OFF],
        "on_output_tokens_per_s": rate[ON],
        "ratio": ratio,
        "target_ratio_min": TARGET_RATIO_MIN,
        "meets_target": ratio >= TARGET_RATIO_MIN,
        "exported": exported,
    }


def run(args: argparse.Namespace) -> int:
    from pagewise.engine.async_engine import AsyncLLMEngine
    from pagewise.engine.config import EngineConfig
    from pagewise.platform.db.migrate import upgrade_head

    if args.quick:
        defaults, prompt_range, output_range = (8, 1), (32, 128), (8, 32)
    else:
        defaults, prompt_range, output_range = (64, 2), (32, 512), (16, 256)
    args.num_requests = args.num_requests or defaults[0]
    args.pairs = args.pairs or defaults[1]
    budget = {"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}
    config = EngineConfig(model=args.model, max_num_seqs=args.max_num_seqs, **budget)
    engine = AsyncLLMEngine(config, progress=False)
    vocab = engine.limits.vocab_size
    workload = make_workload(args.num_requests, prompt_range, output_range, vocab, seed=args.seed)
    progress(
        f"workload: {args.num_requests} requests, {workload.num_prompt_tokens} prompt + "
        f"{workload.num_output_tokens} output tokens a round; {args.pairs} off/on pairs after a warm-up of each"
    )
    try:
        with tempfile.TemporaryDirectory(prefix="pagewise-bench-tracing-") as tmp:
            database_url = f"sqlite+aiosqlite:///{Path(tmp) / 'bench.db'}"
            upgrade_head(database_url)
            result = asyncio.run(_bench(args, workload, engine, database_url))
    finally:
        engine.shutdown()
    if args.json:
        print(json.dumps(result))
    else:
        print_table(
            [
                ("output tok/s, tracing off", result["off_output_tokens_per_s"]),
                ("output tok/s, tracing on", result["on_output_tokens_per_s"]),
                ("ratio (on / off)", result["ratio"]),
                (f"meets >= {TARGET_RATIO_MIN}", "yes" if result["meets_target"] else "no"),
                ("spans exported", result["exported"]["spans"]),
            ]
        )
    return ExitStatus.OK


__all__ = ["alternating", "register", "run"]
