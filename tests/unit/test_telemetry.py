"""The engine's Prometheus families carry vLLM's `model_name` label."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagewise.platform.telemetry import PlatformMetrics


def test_engine_families_are_labelled_with_the_model() -> None:
    stats = {"num_requests_running": 2, "kv_cache_usage_perc": 0.5, "prefix_cache_hits": 7}
    exposition = PlatformMetrics(lambda: stats, "smollm2-135m-instruct").render().decode()
    samples = {s.name: s for f in text_string_to_metric_families(exposition) for s in f.samples}
    for name, value in [
        ("pagewise:num_requests_running", 2),
        ("pagewise:kv_cache_usage_perc", 0.5),
        ("pagewise:prefix_cache_hits_total", 7),
    ]:
        assert samples[name].labels == {"model_name": "smollm2-135m-instruct"}
        assert samples[name].value == value
