"""Smoke tests: each KV benchmark runs end to end in ``--quick`` mode on a tiny random model, prints one JSON
object with its keys, and its target holds in the direction that does not depend on timing."""

from __future__ import annotations

import argparse
import json

import pytest

from pagewise.bench import capacity, parallel_sampling, prefix


@pytest.fixture(scope="module")
def tiny_path(tiny_model) -> str:
    path, _ = tiny_model("bench-llama")
    return str(path)


def _run(module, name: str, model: str, capsys) -> dict:
    parser = argparse.ArgumentParser()
    module.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args([name, "--quick", "--json", "--model", model])
    assert args.func(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return json.loads(out[0])


def test_prefix(tiny_path, capsys):
    result = _run(prefix, "prefix", tiny_path, capsys)
    for key in ("ttft_cold_s", "ttft_warm_s", "ttft_cross_tenant_s", "ttft_ratio", "cross_tenant_ttft_ratio",
                "num_cached_tokens_cold", "num_cached_tokens_warm", "num_cached_tokens_cross_tenant"):
        assert key in result
    # The shared system prompt's full blocks are reused by the same tenant, never by another one.
    assert all(c == 0 for c in result["num_cached_tokens_cold"])
    assert all(c > 0 for c in result["num_cached_tokens_warm"])
    full_blocks = result["system_prompt_tokens"] // result["block_size"] * result["block_size"]
    assert all(c == full_blocks for c in result["num_cached_tokens_warm"])
    assert all(c == 0 for c in result["num_cached_tokens_cross_tenant"])
    assert result["ttft_ratio"] > 0 and result["cross_tenant_ttft_ratio"] > 0


def test_capacity(tiny_path, capsys):
    result = _run(capacity, "capacity", tiny_path, capsys)
    for key in ("kv_cache_memory_bytes", "kv_budget_tokens", "static_concurrent", "paged_running_peak",
                "paged_running_sustained_min", "ratio"):
        assert key in result
    assert result["static_concurrent"] == result["kv_budget_tokens"] // result["max_model_len"] >= 1
    assert result["ratio"] > 1


def test_parallel_sampling(tiny_path, capsys):
    result = _run(parallel_sampling, "parallel-sampling", tiny_path, capsys)
    for key in ("parallel_peak_blocks", "independent_peak_blocks", "block_ratio", "prompt_blocks"):
        assert key in result
    assert result["independent_peak_blocks"] >= result["n"] * result["prompt_blocks"]
    assert result["block_ratio"] < 0.5


def test_step(tiny_path, capsys):
    from pagewise.bench import step

    result = _run(step, "step", tiny_path, capsys)
    assert result["backends"][-1] == "torch"
    for figures in result["contexts"].values():
        for backend in result["backends"]:
            parts = figures[backend]
            assert set(parts) == {*step.PARTS, "total_ms"}
            assert parts["matmul_ms"] > 0 and parts["attention_ms"] > 0 and parts["sampling_ms"] > 0
            assert parts["total_ms"] >= parts["matmul_ms"] + parts["attention_ms"] + parts["sampling_ms"]
        if "cpu" in result["backends"]:
            assert figures["speedup_cpu_vs_torch"] > 0


def test_step_batch_takes_runs_of_the_engines_pool_and_gives_them_back(tiny_path, tmp_path):
    from pagewise.bench import step
    from pagewise.engine.config import EngineConfig
    from pagewise.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=tiny_path, max_model_len=256, max_num_seqs=4, cache_dir=str(tmp_path)))
    batch = step.decode_batch(engine, 4, 100, sampled=False, seed=0)
    tables = [r.block_ids for r in batch.scheduled]
    blocks = -(-100 // engine.block_size)
    assert [len(t) for t in tables] == [blocks] * 4 and len({b for t in tables for b in t}) == 4 * blocks
    assert all(t == list(range(t[0], t[0] + blocks)) for t in tables)  # each sequence's blocks are neighbours
    assert engine.pool.num_free == engine.num_blocks - 4 * blocks
    step.release_batch(engine, batch)
    assert engine.pool.num_free == engine.num_blocks
    engine.kv.check_accounting([])


@pytest.mark.parametrize("sampled", [False, True])
def test_throughput(tiny_path, capsys, sampled):
    from pagewise.bench import throughput

    parser = argparse.ArgumentParser()
    throughput.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["throughput", "--quick", "--json", "--skip-hf", "--model", tiny_path]
                             + (["--sampled"] if sampled else []))
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["sampled"] is sampled
    assert result["engine_tokens_per_s"] > 0 and result["gemm_gflops"] > 0
    assert 0 < result["roofline_fraction"] == pytest.approx(
        result["total_tokens_per_s"] / result["roofline_tokens_per_s"]
    )


def test_gemm(tiny_path, capsys):
    """One JSON line: every candidate path's GFLOP/s on the model's projections, and the engine's choice."""
    from pagewise.bench import gemm

    parser = argparse.ArgumentParser()
    gemm.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["gemm", "--json", "--model", tiny_path])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "torch" in result["candidates"] and min(result["candidates"].values()) > 0
    for plan in ("chosen", "fastest"):
        assert {path for _, path in result[f"{plan}_bands"]} <= set(result["candidates"])
        assert result[plan] in result["candidates"] or " rows, " in result[plan]
    assert result["chosen_source"] in ("measured", "cached")
    assert set(result["by_rows"]) == {"4", "64", "512"}


def test_hop_figures_from_two_histogram_reads():
    from pagewise.bench.distributed import _hop_figures

    before = {"0.001": 1, "0.002": 1, "0.005": 2, "+Inf": 2, "sum": 0.004, "count": 2}
    # four more: 1.5 ms, 1.5 ms, 4 ms, 20 ms
    after = {"0.001": 1, "0.002": 3, "0.005": 5, "+Inf": 6, "sum": 0.004 + 0.027, "count": 6}
    figures = _hop_figures(before, after)
    assert figures["queue_hop_api_requests"] == 4
    assert figures["queue_hop_api_mean_ms"] == pytest.approx(27 / 4)
    assert figures["queue_hop_api_p50_ms"] == pytest.approx(2.0)  # the 2nd of 4 falls at the top of (1, 2] ms
    assert _hop_figures(before, before) == {"queue_hop_api_requests": 0}


def test_lora(tiny_path, capsys):
    """Every run of ``bench lora`` completes on a tiny model with more adapters than slots (so adapters are
    evicted and loaded again), and it reports each figure the docs quote."""
    from pagewise.bench import lora

    parser = argparse.ArgumentParser()
    lora.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(
        ["lora", "--quick", "--json", "--model", tiny_path, "--adapters", "1,3", "--max-loras", "2", "--merged", "3"]
    )
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["base_tokens_per_s"] > 0 and set(result["adapters"]) == {"1", "3"}
    assert result["adapters"]["3"]["slot_loads"] >= 2  # two slots, three adapters: at least one eviction
    assert result["merged_one_at_a_time"]["3"]["batched_vs_merged"] > 0
    assert set(result["delta_ms"]["64_rows_8_adapters"]) <= {"cpu", "torch"}
