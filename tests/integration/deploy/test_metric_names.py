"""Every metric a Grafana panel or an alert rule queries is exported by the running API: `pagewise serve` (a tiny
random-weight model) is scraped as Prometheus scrapes it, with the metrics token, and each name in each query must
be a series of its exposition — a counter as `<name>_total`, a histogram as `_bucket`, `_sum` or `_count` — and
every exported name follows the one naming scheme."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagewise.bench.local_server import local_server

from .stack_files import alert_expressions, dashboard_expressions, metric_names

_SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
METRICS_TOKEN = "metrics-token-for-this-test"


def exported_series(exposition: str) -> set[str]:
    """The series names of a Prometheus exposition, including those of families that have no samples yet (a
    labelled counter before its first increment)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names.update(family.name + suffix for suffix in _SERIES_SUFFIXES.get(family.type, ("",)))
        names.update(sample.name for sample in family.samples)
    return names


@pytest.fixture(scope="module")
def exposition(tmp_path_factory: pytest.TempPathFactory, tiny_model: Callable) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("metrics")
    model, _ = tiny_model("metrics-names")
    args = ["--model", str(model), "--max-model-len", "128", "--kv-cache-memory-bytes", str(4 * 2**20)]
    serve = (sys.executable, "-m", "pagewise.cli", "serve")
    database_url = f"sqlite+aiosqlite:///{workdir / 'metrics.db'}"
    env = {"PAGEWISE_METRICS_TOKEN": METRICS_TOKEN}
    with local_server(workdir, database_url, args, env=env, command=serve) as server:
        response = httpx.get(f"{server.base}/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
        assert response.status_code == 200, response.text
        yield response.text


def test_metric_names_are_what_remains_of_an_expression_without_labels_functions_and_numbers() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le) (rate(a:b_bucket{x="}", job=~"w.*"}[$__rate_interval])))'
        " / on (instance) group_left c_total offset 5m > bool 1e-9 and d"
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total", "d"}


def test_the_queries_name_the_engine_and_platform_metrics() -> None:
    """Guards the parser on the real files: it finds names of each kind, so the next test checks something."""
    queried = set().union(*(metric_names(expr) for _, expr in [*alert_expressions(), *dashboard_expressions()]))
    kinds = {"pagewise:kv_cache_usage_perc", "pagewise_requests_total", "pagewise:time_to_first_token_seconds_bucket"}
    assert kinds <= queried


@pytest.mark.parametrize(
    ("source", "expr"), [*alert_expressions(), *dashboard_expressions()], ids=lambda value: value[:60]
)
def test_each_queried_metric_is_exported(source: str, expr: str, exposition: str) -> None:
    missing = metric_names(expr) - exported_series(exposition)
    assert not missing, f"{source} queries {sorted(missing)}, which the API does not export"


def test_exported_series_reads_families_without_samples() -> None:
    text = "# HELP a_total h\n# TYPE a_total counter\n# HELP b h\n# TYPE b histogram\n# TYPE c gauge\nc 1\n"
    assert exported_series(text) == {"a_total", "b_bucket", "b_sum", "b_count", "c"}


def test_one_naming_scheme_engine_families_by_model_platform_families_by_tenant(exposition: str) -> None:
    """`pagewise:` families are the engine's, each sample labelled with its `model_name` (the fair scheduler's
    per-tenant gauges aside); `pagewise_` families are the platform's; vLLM's histograms are all there."""
    families = list(text_string_to_metric_families(exposition))
    assert families and all(f.name.startswith(("pagewise:", "pagewise_")) for f in families)
    engine = [f for f in families if f.name.startswith("pagewise:") and not f.name.startswith("pagewise:tenant_")]
    assert all(s.labels.get("model_name") for f in engine for s in f.samples)
    assert not any("model_name" in s.labels for f in families if f.name.startswith("pagewise_") for s in f.samples)
    histograms = {f.name for f in engine if f.type == "histogram" and f.samples}
    assert histograms == {
        f"pagewise:{name}"
        for name in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_decode_time_seconds",
            "iteration_tokens_total",
        )
    }
