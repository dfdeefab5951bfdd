"""The Prometheus exposition: engine families under `pagewise:` with vLLM's `model_name` label, read from a real
engine's stats at scrape time (histograms included), platform families under `pagewise_`."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pagewise import LLM, SamplingParams
from pagewise.platform.telemetry import PlatformMetrics

ENGINE_HISTOGRAMS = {
    "pagewise:time_to_first_token_seconds",
    "pagewise:inter_token_latency_seconds",
    "pagewise:e2e_request_latency_seconds",
    "pagewise:request_queue_time_seconds",
    "pagewise:request_prefill_time_seconds",
    "pagewise:request_decode_time_seconds",
    "pagewise:iteration_tokens_total",
}


def _families(metrics: PlatformMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(metrics.render().decode())}


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


def test_every_name_follows_the_scheme_and_histograms_are_declared_without_an_engine() -> None:
    """An API replica in distributed mode has no engine histograms: their families exist, with no samples."""
    families = _families(PlatformMetrics(lambda: {"num_requests_running": 1}, "m"))
    assert {n for n, f in families.items() if f.type == "histogram" and n.startswith("pagewise:")} == ENGINE_HISTOGRAMS
    assert all(not families[name].samples for name in ENGINE_HISTOGRAMS)
    assert all(name.startswith(("pagewise:", "pagewise_")) for name in families)
    engine = {n for n, f in families.items() if n.startswith("pagewise:") and not n.startswith("pagewise:tenant_")}
    assert all(s.labels.get("model_name") == "m" for n in engine for s in families[n].samples)
    platform = {n for n in families if n.startswith("pagewise_")}
    assert {"pagewise_requests", "pagewise_tokens", "pagewise_api_time_to_first_token_seconds"} <= platform


def test_engine_histograms_are_the_engine_counts_at_scrape_time(tiny_model) -> None:
    path, _ = tiny_model("telemetry-llama")
    llm = LLM(str(path), block_size=4, max_num_batched_tokens=8, progress=False, dtype="float32")
    metrics = PlatformMetrics(llm.stats, "tiny")
    before = _families(metrics)
    assert all(s.value == 0 for n in ENGINE_HISTOGRAMS for s in before[n].samples)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([[5] * 10, [6] * 3], params, use_tqdm=False)
    families, stats = _families(metrics), llm.stats()  # read again: nothing was pushed to the registry
    for name in ENGINE_HISTOGRAMS:
        snapshot = stats[name.removeprefix("pagewise:")]
        samples = families[name].samples
        assert all(s.labels["model_name"] == "tiny" for s in samples)
        buckets = [s for s in samples if s.name == f"{name}_bucket"]
        assert [s.value for s in buckets] == sorted(s.value for s in buckets)  # cumulative
        assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == snapshot.count > 0
        assert len(buckets) == len(snapshot.bounds) + 1
        total = next(s for s in samples if s.name == f"{name}_sum")
        assert total.value == snapshot.sum
    count = {n: next(s.value for s in families[n].samples if s.name == f"{n}_count") for n in ENGINE_HISTOGRAMS}
    assert count["pagewise:time_to_first_token_seconds"] == count["pagewise:e2e_request_latency_seconds"] == 2
    assert count["pagewise:inter_token_latency_seconds"] == 2 * 4
    iteration = families["pagewise:iteration_tokens_total"].samples
    assert next(s.value for s in iteration if s.name.endswith("_sum")) == 13 + 2 * 4  # prompts, one per decode
