"""Prometheus metrics, one naming scheme: what an engine measures under `pagewise:` with vLLM's names and meanings
and a `model_name` label; what the platform measures under `pagewise_` (counters by tenant and status, the
API's own view of latency by endpoint).

The engine keeps no Prometheus state: `EngineStatsCollector` reads the engine's `stats()` at scrape time —
gauges, counters, and histograms as cumulative counts (`HistogramSnapshot`, see
`pagewise.engine.request_metrics`, which says where each latency is measured). A process without an engine (an
API replica in distributed mode) gets its workers' summed gauges and counters from their heartbeats but no
engine histograms: every family is still declared, and the workers' own `/metrics` carry the samples.

Each app owns its registry (no global state), so several apps — e.g. in tests — never collide.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from pagewise.engine.request_metrics import HistogramSnapshot
    from pagewise.serving.protocol import Finished, Submit

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_HOP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.005, 0.0075, 0.01, 0.015, 0.025, 0.05, 0.1, 0.25, 1.0)
_TOKEN_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
# engine stats key -> help; each is `pagewise:<key>` (a counter's `_total` is Prometheus' own suffix)
_ENGINE_GAUGES = {
    "num_requests_running": "Requests in the engine's running batch.",
    "num_requests_waiting": "Requests waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (0-1).",
    "kv_blocks_total": "KV-cache blocks in the pool.",
    "kv_blocks_free": "KV-cache blocks free.",
}
_ENGINE_COUNTERS = {
    "num_preemptions": "Preemptions since start.",
    "prompt_tokens_total": "Prompt tokens processed (prefix-cache hits included; a recompute counts once).",
    "generation_tokens_total": "Tokens generated.",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache.",
    "steps_paused": "Steps paused between two parts of a layer for an interrupting step.",
    "step_interrupts": "Interrupting steps run while another step was paused.",
    "step_time_paused_seconds": "Seconds steps spent paused (the interrupting steps' time).",
}
_ENGINE_HISTOGRAMS = {
    "time_to_first_token_seconds": "Arrival in the engine to the first token sampled.",
    "inter_token_latency_seconds": "Time between two consecutive tokens of one sample.",
    "e2e_request_latency_seconds": "Arrival in the engine to the finish, for requests finished in the engine.",
    "request_queue_time_seconds": "Arrival to the start of the step that first scheduled the request.",
    "request_prefill_time_seconds": "First scheduled to the first token (the prompt's processing).",
    "request_decode_time_seconds": "First token to the finish (the generation).",
    "iteration_tokens_total": "Tokens computed per engine step (prefill chunks plus one per decode).",
}


class EngineStatsCollector(Collector):
    """Reads the engine's stats at scrape time; the engine keeps no Prometheus state of its own. Every engine
    family carries vLLM's `model_name` label: the model the stats are of."""

    def __init__(self, stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self._stats = stats
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats, model = self._stats(), [self._model_name]
        for key, help_text in _ENGINE_GAUGES.items():
            family = GaugeMetricFamily(f"pagewise:{key}", help_text, labels=["model_name"])
            family.add_metric(model, float(stats.get(key, 0)))
            yield family
        for key, help_text in _ENGINE_COUNTERS.items():
            family = CounterMetricFamily(f"pagewise:{key.removesuffix('_total')}", help_text, labels=["model_name"])
            family.add_metric(model, float(stats.get(key, 0)))
            yield family
        for key, help_text in _ENGINE_HISTOGRAMS.items():
            family = HistogramMetricFamily(f"pagewise:{key}", help_text, labels=["model_name"])
            snapshot = stats.get(key)
            if snapshot is not None:
                family.add_metric(model, _buckets(snapshot), snapshot.sum)
            yield family
        yield from _tenant_gauges(stats.get("tenants", {}))


def _buckets(snapshot: HistogramSnapshot) -> list[tuple[str, float]]:
    """Prometheus' cumulative `le` buckets, `+Inf` last."""
    bounds = [*map(floatToGoString, snapshot.bounds), "+Inf"]
    return list(zip(bounds, itertools.accumulate(snapshot.counts), strict=True))


_TENANT_GAUGES = {
    "served": ("pagewise:tenant_served_tokens", "Fair-share counter: weighted tokens served to the tenant."),
    "running": ("pagewise:tenant_requests_running", "The tenant's sequences in the running batch."),
    "waiting": ("pagewise:tenant_requests_waiting", "The tenant's sequences waiting to be scheduled."),
}


def _tenant_gauges(tenants: dict[str, dict[str, float]]) -> Iterator[Metric]:
    """Per-tenant scheduling state under the fair policy (active tenants only)."""
    for key, (name, help_text) in _TENANT_GAUGES.items():
        family = GaugeMetricFamily(name, help_text, labels=["tenant"])
        for tenant, values in tenants.items():
            family.add_metric([tenant], float(values[key]))
        yield family


class PlatformMetrics:
    def __init__(self, engine_stats: Callable[[], dict[str, Any]], model_name: str) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pagewise_requests", "Finished API requests.", ["tenant", "endpoint", "status"], registry=r
        )
        self.tokens = Counter("pagewise_tokens", "Billed tokens.", ["tenant", "kind"], registry=r)
        self.quota_rejections = Counter(
            "pagewise_quota_rejections", "Requests rejected by a quota.", ["tenant", "reason"], registry=r
        )
        # as the API saw them: queueing in the transport, persistence and a worker's hop included
        self.e2e_latency = Histogram(
            "pagewise_api_request_latency_seconds",
            "Admission by the API to the terminal event it read.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pagewise_api_time_to_first_token_seconds",
            "Admission by the API to the first token it read.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pagewise_api_time_per_output_token_seconds",
            "Mean time between the output tokens the API read.",
            ["endpoint"],
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_hop = Histogram(
            "pagewise_api_queue_hop_seconds",
            "Hand-over to the transport until the first token reached this API replica, minus the engine side's own"
            " time to that token: the trip API -> engine -> API (first attempt of requests this replica admitted).",
            buckets=_HOP_BUCKETS,
            registry=r,
        )
        r.register(EngineStatsCollector(engine_stats, model_name))

    def observe_settled(self, submit: Submit, finished: Finished) -> None:
        """Count one settled request and its billed tokens (by the process that wrote its final row)."""
        tenant, usage = submit.tenant_id, finished.usage
        self.requests.labels(tenant, submit.endpoint, finished.status).inc()
        self.tokens.labels(tenant, "prompt").inc(usage.prompt_tokens)
        self.tokens.labels(tenant, "completion").inc(usage.completion_tokens)
        self.tokens.labels(tenant, "cached").inc(usage.cached_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
