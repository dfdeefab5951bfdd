"""Small helpers shared by the ``pagewise bench`` subcommands: progress lines, tables, percentiles, engine
stepping, a tenant for a benchmark."""

from __future__ import annotations

import math
import random
import statistics
import sys
import time


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries only the result: a table, or one JSON object)."""
    print(message, file=sys.stderr, flush=True)


def print_table(rows: list[tuple[str, object]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        if isinstance(value, float):
            text = f"{value:.3f}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            text = str(value)
        print(f"{name:<{width}}  {text:>14}")


def random_tokens(count: int, vocab_size: int, rng: random.Random) -> list[int]:
    """Random token ids, avoiding the lowest ids (special tokens in the Llama-family vocabularies we ship)."""
    return [rng.randrange(3, vocab_size) for _ in range(count)]


def blocks_in_use(engine) -> int:
    stats = engine.stats()
    return stats["kv_blocks_total"] - stats["kv_blocks_free"]


def add_model_arg(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF directory or GGUF file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), `q` in [0, 100]."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def latency_summary(name: str, seconds: list[float]) -> dict[str, float]:
    """`{name}_mean_ms` and `{name}_p50/p90/p99_ms` of latencies given in seconds."""
    ms = [s * 1000 for s in seconds]
    out = {f"{name}_mean_ms": statistics.fmean(ms) if ms else math.nan}
    out.update({f"{name}_p{q}_ms": percentile(ms, q) for q in (50, 90, 99)})
    return out


def create_inference_key(base: str, admin_key: str) -> str:
    """A fresh tenant with no limits and an inference key for it, through the admin API."""
    import httpx

    admin = {"Authorization": f"Bearer {admin_key}"}
    name = f"bench-{int(time.time() * 1000)}"
    unlimited = dict.fromkeys(
        ("requests_per_minute", "tokens_per_minute", "max_concurrent_requests", "max_tokens_per_request", "max_n")
    )
    tenant = httpx.post(f"{base}/admin/tenants", json={"name": name, **unlimited}, headers=admin, timeout=30)
    tenant.raise_for_status()
    key = httpx.post(f"{base}/admin/tenants/{tenant.json()['id']}/keys", json={}, headers=admin, timeout=30)
    key.raise_for_status()
    return key.json()["key"]


def served_model(base: str, key: str, wanted: str) -> str:
    """`wanted` if the server at `base` serves it, else the first model it serves (said on stderr)."""
    import httpx

    response = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    response.raise_for_status()
    served = [m["id"] for m in response.json()["data"]]
    if wanted not in served:
        progress(f"the server serves {served}, not {wanted}: using {served[0]}")
        return served[0]
    return wanted
