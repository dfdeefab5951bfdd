"""``pagewise bench batch``: a batch uses the engine's spare capacity without slowing interactive traffic.

One ``pagewise serve`` (engine core in a child process, fair scheduling, ``--max-model-len`` 1,024) on a fresh
SQLite database in a temporary folder. Two tenants: an interactive one that streams one chat request a second
(a ``--interactive-prompt-words`` prompt, ``--interactive-max-tokens`` tokens, open loop), and a batch one. Three
phases of ``--duration`` seconds each, after ``--warmup`` seconds unmeasured:

- ``solo``: the interactive tenant alone — its TTFT (request sent to the first streamed token) is the baseline;
- ``full_load``: the engine alone at full load — ``--full-load-streams`` closed-loop streams of the batch's own
  requests (random prompts of U[``--line-prompt-words``] words, ``--line-max-tokens`` tokens, ``ignore_eos``);
- ``batch``: a batch of ``--lines`` such requests (uploaded with ``POST /v1/files``, created with
  ``POST /v1/batches``) while the interactive tenant sends its requests; cancelled at the end of the window.

Processed tokens/s is prompt positions reached plus tokens generated, read from ``/admin/engine``'s counters at
the window's ends. The figures: ``interactive_ttft_p99_ratio`` = the batch phase's interactive p99 / solo p99
(target <= 1.5); ``batch_share_of_spare`` = (the batch phase's processed tokens/s - the interactive tenant's own,
as in solo) / (full load's - the interactive tenant's own) (target >= 0.8). ``--quick`` shrinks every default so a
test runs it in seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagewise.bench._common import Timer, create_inference_key, latency_summary, print_table, progress
from pagewise.exit_status import ExitStatus

TARGET_TTFT_P99_RATIO_MAX = 1.5
TARGET_BATCH_SHARE_MIN = 0.8
_WORDS = ("alpha", "river", "stone", "light", "market", "garden", "signal", "copper", "winter", "orbit", "paper")
# flag -> (full default, --quick default)
_DEFAULTS: dict[str, tuple[Any, Any]] = {
    "lines": (1000, 600),
    "line_prompt_words": ((64, 256), (16, 48)),
    "line_max_tokens": (32, 8),
    "full_load_streams": (64, 16),
    "interactive_prompt_words": (24, 12),
    "interactive_max_tokens": (4, 2),
    "duration": (30.0, 4.0),
    "warmup": (5.0, 2.0),
}


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def _line_body(model: str, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    content = _text(rng, rng.randint(*args.line_prompt_words))
    return {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": args.line_max_tokens,
            "temperature": 0, "ignore_eos": True}


def _has_token(line: str) -> bool:
    """Whether an SSE line is a chunk carrying text (the role chunk's content is empty)."""
    return line.startswith("data: {") and '"content":"' in line and '"content":""' not in line


async def _processed(http, base: str, admin: dict[str, str]) -> int:
    stats = (await http.get(f"{base}/admin/engine", headers=admin)).json()["stats"]
    return stats["prompt_tokens_total"] + stats["generation_tokens_total"]


async def _interactive(
    http, base: str, key: str, model: str, args: argparse.Namespace, seconds: float
) -> list[tuple[str, float]]:
    """One streamed request a second for `seconds`, open loop; the id and TTFT (seconds) of each."""
    rng, ttfts = random.Random(f"interactive:{time.time()}"), []

    async def one() -> None:
        body = {"model": model, "messages": [{"role": "user", "content": _text(rng, args.interactive_prompt_words)}],
                "max_tokens": args.interactive_max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        start = time.perf_counter()
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as response:
            response.raise_for_status()
            first, request_id = None, None
            async for line in response.aiter_lines():
                if first is None and _has_token(line):
                    first = time.perf_counter() - start
                    request_id = json.loads(line.removeprefix("data: "))["id"]
        if first is not None:
            ttfts.append((request_id, first))

    tasks, begin = [], time.perf_counter()
    for k in range(int(seconds)):
        await asyncio.sleep(max(0.0, begin + k - time.perf_counter()))
        tasks.append(asyncio.create_task(one()))
    await asyncio.gather(*tasks)
    return ttfts


async def _breakdown(http, base: str, key: str, measured: list[tuple[str, float]]) -> dict[str, float]:
    """Where the interactive requests' TTFT went, from their rows (p50 / p99 ms of each part): `before_row` —
    request sent to its row written (auth, preparation, admission) plus first token to the client (delivery);
    `hand_over` — row written to the engine side taking it; `engine` — taken to first token (the engine's queue,
    its steps, the pipe back)."""
    parts: dict[str, list[float]] = {"before_row_and_delivery": [], "hand_over": [], "engine": []}
    for request_id, ttft in measured:
        row = (await http.get(f"{base}/v1/requests/{request_id}", headers={"Authorization": f"Bearer {key}"})).json()
        if row.get("started_at") is None or row.get("first_token_at") is None:
            continue
        queued, started, first = (dt.datetime.fromisoformat(row[f]).timestamp() for f in
                                  ("queued_at", "started_at", "first_token_at"))
        parts["before_row_and_delivery"].append(ttft - (first - queued))
        parts["hand_over"].append(started - queued)
        parts["engine"].append(first - started)
    out = {}
    for name, values in parts.items():
        summary = latency_summary(name, values)
        out.update({k: v for k, v in summary.items() if k.endswith(("p50_ms", "p99_ms"))})
    return out


async def _window(http, base: str, admin: dict[str, str], seconds: float, work) -> tuple[float, Any]:
    """Processed tokens/s over `seconds` while `work` (a coroutine) runs; and what `work` returned."""
    before = await _processed(http, base, admin)
    start = time.perf_counter()
    result = await work
    elapsed = max(seconds, time.perf_counter() - start)
    return (await _processed(http, base, admin) - before) / elapsed, result


async def _full_load(http, base: str, key: str, model: str, args: argparse.Namespace, seconds: float) -> None:
    rng, stop = random.Random("full"), time.perf_counter() + seconds

    async def stream() -> None:
        while time.perf_counter() < stop:
            body = _line_body(model, rng, args)
            response = await http.post(f"{base}/v1/chat/completions", json=body,
                                       headers={"Authorization": f"Bearer {key}"})
            response.raise_for_status()

    await asyncio.gather(*(stream() for _ in range(args.full_load_streams)))


async def _start_batch(http, base: str, key: str, model: str, args: argparse.Namespace) -> str:
    rng, auth = random.Random("batch"), {"Authorization": f"Bearer {key}"}
    lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": _line_body(model, rng, args)} for i in range(args.lines)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file = await http.post(f"{base}/v1/files", files={"file": ("batch.jsonl", content)}, data={"purpose": "batch"},
                           headers=auth)
    file.raise_for_status()
    body = {"input_file_id": file.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = await http.post(f"{base}/v1/batches", json=body, headers=auth)
    batch.raise_for_status()
    return batch.json()["id"]


async def _phases(base: str, admin_key: str, args: argparse.Namespace) -> dict[str, Any]:
    import httpx

    admin = {"Authorization": f"Bearer {admin_key}"}
    interactive_key, batch_key = create_inference_key(base, admin_key), create_inference_key(base, admin_key)
    async with httpx.AsyncClient(timeout=600) as http:
        model = (await http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {batch_key}"})).json()
        model = model["data"][0]["id"]
        d = args.duration
        await _interactive(http, base, interactive_key, model, args, args.warmup)
        solo_tps, solo = await _window(http, base, admin, d, _interactive(http, base, interactive_key, model, args, d))
        solo_parts = await _breakdown(http, base, interactive_key, solo)
        progress(f"solo: {len(solo)} interactive requests, {solo_tps:.0f} processed tok/s")
        await _full_load(http, base, batch_key, model, args, args.warmup)
        full_tps, _ = await _window(http, base, admin, d, _full_load(http, base, batch_key, model, args, d))
        progress(f"full load: {full_tps:.0f} processed tok/s")
        batch_id = await _start_batch(http, base, batch_key, model, args)
        await asyncio.sleep(args.warmup)
        interactive = _interactive(http, base, interactive_key, model, args, d)
        mixed_tps, mixed = await _window(http, base, admin, d, interactive)
        mixed_parts = await _breakdown(http, base, interactive_key, mixed)
        state = (await http.get(f"{base}/v1/batches/{batch_id}", headers={"Authorization": f"Bearer {batch_key}"}))
        counts = state.json()["request_counts"]
        await http.post(f"{base}/v1/batches/{batch_id}/cancel", headers={"Authorization": f"Bearer {batch_key}"})
        progress(f"batch: {len(mixed)} interactive requests, {mixed_tps:.0f} processed tok/s, lines done {counts}")
    return {
        "solo": (solo_tps, [t for _, t in solo]),
        "full_load": full_tps,
        "batch": (mixed_tps, [t for _, t in mixed]),
        "batch_counts": counts,
        "ttft_parts": {"solo": solo_parts, "batch": mixed_parts},
    }


def run(args: argparse.Namespace) -> int:
    from pagewise.bench.local_server import local_server

    for name, (full, quick) in _DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    clock = Timer()
    with tempfile.TemporaryDirectory(prefix="pagewise-bench-batch-") as folder:
        work = Path(folder)
        database_url = f"sqlite+aiosqlite:///{work / 'bench.db'}"
        env = {"PAGEWISE_EXPORT_DIR": str(work / "exports")}
        progress(f"starting pagewise serve, {clock}")
        try:
            with local_server(work, database_url, ["--max-model-len", "1024"], env=env) as server:
                phases = asyncio.run(_phases(server.base, server.admin_key, args))
            result = _result(args, phases)
        except RuntimeError as error:
            print(f"error: {error}", file=sys.stderr)
            return ExitStatus.FAILED
    result["bench_seconds"] = time.perf_counter() - clock.start
    if args.json:
        print(json.dumps(result))
    else:
        print_table([(k, v) for k, v in result.items() if not isinstance(v, dict)])
    return ExitStatus.OK


def _result(args: argparse.Namespace, phases: dict[str, Any]) -> dict[str, Any]:
    solo_tps, solo = phases["solo"]
    mixed_tps, mixed = phases["batch"]
    if not solo or not mixed:
        raise RuntimeError("no interactive request got a token; raise --duration")
    solo_summary, mixed_summary = latency_summary("ttft", solo), latency_summary("ttft", mixed)
    ratio = mixed_summary["ttft_p99_ms"] / solo_summary["ttft_p99_ms"]
    spare = phases["full_load"] - solo_tps
    share = (mixed_tps - solo_tps) / spare if spare > 0 else float("nan")
    return {
        "workload": {name: getattr(args, name) for name in _DEFAULTS},
        "solo": {**solo_summary, "requests": len(solo), "processed_tokens_per_s": solo_tps},
        "full_load": {"processed_tokens_per_s": phases["full_load"]},
        "batch": {**mixed_summary, "requests": len(mixed), "processed_tokens_per_s": mixed_tps,
                  "request_counts_at_end": phases["batch_counts"]},
        "interactive_ttft_parts": phases["ttft_parts"],
        "interactive_ttft_p99_ratio": ratio,
        "batch_share_of_spare": share,
        "target_interactive_ttft_p99_ratio_max": TARGET_TTFT_P99_RATIO_MAX,
        "target_batch_share_of_spare_min": TARGET_BATCH_SHARE_MIN,
        "meets_targets": ratio <= TARGET_TTFT_P99_RATIO_MAX and share >= TARGET_BATCH_SHARE_MIN,
    }


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``batch`` to the ``pagewise bench`` subcommands."""
    parser = subparsers.add_parser(
        "batch", help="a batch in the engine's spare capacity: interactive TTFT and the batch's share of the spare"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    parser.add_argument("--quick", action="store_true", help="small defaults, for a test")
    parser.add_argument("--lines", type=int, help="batch lines (default 1000; --quick 600)")
    parser.add_argument("--line-prompt-words", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help="a line's prompt length in words (default 64 256)")
    parser.add_argument("--line-max-tokens", type=int, help="a line's output tokens (default 32)")
    parser.add_argument("--full-load-streams", type=int, help="closed-loop streams of the full-load phase (64)")
    parser.add_argument("--interactive-prompt-words", type=int, help="interactive prompt length in words (24)")
    parser.add_argument("--interactive-max-tokens", type=int, help="interactive output tokens (4)")
    parser.add_argument("--duration", type=float, help="measured seconds per phase (default 30)")
    parser.add_argument("--warmup", type=float, help="unmeasured seconds before each phase (default 5)")
    parser.set_defaults(func=run)
