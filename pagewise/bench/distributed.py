"""The distributed mode's own figures, for `pagewise bench serving --workers N`.

- Queue hop: sequential streamed requests; for each, the client's TTFT minus the engine's own TTFT (its row's
  `first_token_at - started_at`, stamped by the worker). What remains is the API's admission (auth, quota, the
  queued row) plus the Redis round trip API → worker → first delta → API. The same phase runs in embedded mode
  for comparison, where the hop is the in-process loopback. With an admin key the phase also reads the API's
  own measure of the trip alone, `pagewise_api_queue_hop_seconds` (hand-over to the transport → first token at
  the API, minus the engine side's time to that token), before and after: its exact mean over the phase and a
  median interpolated inside its buckets (`queue_hop_api_*`).
- Prefix affinity: `tenants` tenants, each with a long prefix of its own, send `per_tenant` requests one after the
  other (tenants in parallel). `cached_token_ratio` is cached / prompt tokens over all of them. Run on one worker,
  on N workers with tenant-affine routing, and on N workers routing blind (least loaded): the ratio of N workers
  to one says how much of the prefix cache routing keeps.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import time
from pathlib import Path
from typing import Any

from pagewise.bench._common import progress as log
from pagewise.bench.stack import distributed_stack

HOP_REQUESTS = 30
AFFINITY_TENANTS = 6
AFFINITY_PER_TENANT = 6


def _percentile(values: list[float], q: float) -> float:
    from pagewise.bench._common import percentile

    return percentile(values, q)


async def queue_hop(
    base: str, key: str, model: str, requests: int = HOP_REQUESTS, metrics_key: str | None = None
) -> dict[str, float]:
    """Client TTFT minus engine TTFT over `requests` sequential streamed completions (and, with `metrics_key`,
    the API's own hop histogram over them)."""
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    hops, admission = [], []
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as client:
        before = await _hop_histogram(client, metrics_key) if metrics_key else None
        for i in range(requests + 2):  # two warm-ups
            body = {"model": model, "prompt": f"Hop {i}: count to three.", "max_tokens": 2, "temperature": 0,
                    "stream": True}
            start = time.perf_counter()
            ttft, request_id = None, None
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and ttft is None:
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["text"]:
                            ttft, request_id = time.perf_counter() - start, chunk["id"]
            if i < 2 or ttft is None:
                continue
            row = (await client.get(f"/v1/requests/{request_id}")).json()
            started, first = _when(row["started_at"]), _when(row["first_token_at"])
            hops.append((ttft - (first - started)) * 1000)
            admission.append((started - _when(row["queued_at"])) * 1000)
        api = {}
        if before is not None:
            after = await _hop_histogram(client, metrics_key)
            api = _hop_figures(before, after)
    return {
        "queue_hop_p50_ms": _percentile(hops, 50),
        "queue_hop_p99_ms": _percentile(hops, 99),
        "admission_to_engine_p50_ms": _percentile(admission, 50),
        "queue_hop_requests": len(hops),
        **api,
    }


_HOP = "pagewise_api_queue_hop_seconds"


async def _hop_histogram(client, metrics_key: str) -> dict[str, float]:  # noqa: ANN001 - an httpx client
    """The API's hop histogram now: cumulative bucket counts by upper bound (`+Inf` included), `sum`, `count`."""
    from prometheus_client.parser import text_string_to_metric_families

    response = await client.get("/metrics", headers={"Authorization": f"Bearer {metrics_key}"})
    response.raise_for_status()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        if family.name != _HOP:
            continue
        for sample in family.samples:
            if sample.name == f"{_HOP}_bucket":
                samples[sample.labels["le"]] = sample.value
            elif sample.name in (f"{_HOP}_sum", f"{_HOP}_count"):
                samples[sample.name.removeprefix(f"{_HOP}_")] = sample.value
    return samples


def _hop_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean (exact) and median (linear inside the bucket that holds it) of the observations between two reads."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"queue_hop_api_requests": 0}
    bounds = sorted((float(le), after[le] - before.get(le, 0.0)) for le in after if le not in ("sum", "count"))
    median, lower, below = float("nan"), 0.0, 0.0
    for upper, cumulative in bounds:
        if cumulative >= count / 2:
            inside = cumulative - below
            median = upper if upper == float("inf") else lower + (upper - lower) * (count / 2 - below) / inside
            break
        lower, below = upper, cumulative
    return {
        "queue_hop_api_requests": int(count),
        "queue_hop_api_mean_ms": (after["sum"] - before["sum"]) / count * 1000,
        "queue_hop_api_p50_ms": median * 1000,
    }


def _when(value: str) -> float:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


async def _cached_ratio(base: str, admin_key: str, model: str, tenants: int, per_tenant: int) -> dict[str, float]:
    import httpx

    from pagewise.bench._common import create_inference_key

    keys = [await asyncio.to_thread(create_inference_key, base, admin_key) for _ in range(tenants)]
    totals = {"prompt": 0, "cached": 0}

    async def tenant(t: int, client: httpx.AsyncClient) -> None:
        prefix = f"Tenant {t} handbook. " + " ".join(f"Rule {t}.{r}: be precise and kind." for r in range(30))
        for i in range(per_tenant):
            body = {"model": model, "prompt": f"{prefix}\nQuestion {i}: what is rule {i}?", "max_tokens": 2,
                    "temperature": 0}
            response = await client.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {keys[t]}"})
            response.raise_for_status()
            usage = response.json()["usage"]
            totals["prompt"] += usage["prompt_tokens"]
            totals["cached"] += usage["prompt_tokens_details"]["cached_tokens"]

    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        await asyncio.gather(*(tenant(t, client) for t in range(tenants)))
    return {"cached_tokens": totals["cached"], "prompt_tokens": totals["prompt"],
            "ratio": totals["cached"] / totals["prompt"]}


def migrated_sqlite(directory: Path) -> str:
    """A fresh, migrated SQLite database in `directory` (each stack bootstraps its own admin key)."""
    from pagewise.platform.db.migrate import upgrade_head

    url = f"sqlite+aiosqlite:///{directory / 'bench.db'}"
    upgrade_head(url)
    return url


def prefix_affinity(
    workdir: Path, engine_args: list[str], workers: int, model: str,
    tenants: int = AFFINITY_TENANTS, per_tenant: int = AFFINITY_PER_TENANT,
) -> dict[str, Any]:
    """Cached-token ratios on 1 worker, `workers` workers with affinity and without; a fresh stack (and database)
    for each."""
    runs: dict[str, dict[str, float]] = {}
    for name, count, affinity in (("1w", 1, True), (f"{workers}w_affinity", workers, True),
                                  (f"{workers}w_blind", workers, False)):
        log(f"prefix affinity: {name} ({tenants} tenants x {per_tenant} requests)")
        env = {"PAGEWISE_ROUTING_AFFINITY": "true" if affinity else "false"}
        run_dir = workdir / name
        run_dir.mkdir()
        with distributed_stack(run_dir, migrated_sqlite(run_dir), engine_args, workers=count, env=env) as stack:
            runs[name] = asyncio.run(_cached_ratio(stack.api.base, stack.api.admin_key, model, tenants, per_tenant))
    single = runs["1w"]["ratio"]
    return {
        "cached_token_ratio": runs[f"{workers}w_affinity"]["ratio"] / single,
        "cached_token_ratio_blind": runs[f"{workers}w_blind"]["ratio"] / single,
        "cached_fraction_by_run": {name: run["ratio"] for name, run in runs.items()},
    }
