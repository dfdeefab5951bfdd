"""What the overview shows live: the engine's gauges and counters, and the quota refusals since start.

Read from the running services at request time; nothing here is stored. The browser polls `live_stats` and
derives throughput from two readings of the token counters.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from pagewise.platform.services import PlatformServices
from pagewise.platform.telemetry import PlatformMetrics


class LiveStats(msgspec.Struct, kw_only=True):
    running: int
    waiting: int
    kv_usage: float  # 0-1
    prefix_hit_rate: float  # 0-1: prompt tokens found in the prefix cache / looked up
    prompt_tokens_total: int
    generation_tokens_total: int
    quota_rejections: int  # 429s since this process started (not persisted)
    at: float  # unix seconds of the reading


def prefix_hit_rate(stats: dict[str, Any]) -> float:
    queries = stats.get("prefix_cache_queries", 0)
    return stats.get("prefix_cache_hits", 0) / queries if queries else 0.0


def quota_rejections(metrics: PlatformMetrics) -> int:
    """Requests refused by a quota (429) since this process started, over all tenants and reasons."""
    return int(
        sum(
            sample.value
            for family in metrics.quota_rejections.collect()
            for sample in family.samples
            if sample.name.endswith("_total")
        )
    )


def live_stats(services: PlatformServices) -> LiveStats:
    stats = services.engine.stats()
    return LiveStats(
        running=int(stats.get("num_requests_running", 0)),
        waiting=int(stats.get("num_requests_waiting", 0)),
        kv_usage=float(stats.get("kv_cache_usage_perc", 0.0)),
        prefix_hit_rate=prefix_hit_rate(stats),
        prompt_tokens_total=int(stats.get("prompt_tokens_total", 0)),
        generation_tokens_total=int(stats.get("generation_tokens_total", 0)),
        quota_rejections=quota_rejections(services.metrics),
        at=time.time(),
    )
