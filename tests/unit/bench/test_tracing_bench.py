"""`pagewise bench tracing --quick --json` end to end on a tiny random model: one JSON object on stdout, its rounds
alternating, and the on-rounds' spans received over OTLP/HTTP — the engine's spans of every request of them. The
ratio's target is the bench's to report: timings on a shared machine are too noisy to assert."""

from __future__ import annotations

import argparse
import json
import math

from pagewise.bench import tracing as tracing_bench


def test_alternating_puts_each_mode_first_in_half_the_pairs() -> None:
    assert tracing_bench.alternating(3) == ["off", "on", "on", "off", "off", "on"]


def test_bench_tracing_quick_json(tiny_model, capsys) -> None:
    path, _ = tiny_model("bench-tracing-llama")
    parser = argparse.ArgumentParser()
    tracing_bench.register(parser.add_subparsers(dest="bench"))
    args = parser.parse_args(["tracing", "--quick", "--json", "--model", str(path)])
    assert args.func(args) == 0
    captured = capsys.readouterr()
    [line] = captured.out.strip().splitlines()
    result = json.loads(line)
    assert "round 2, tracing on" in captured.err

    assert result["num_requests"] == 8 and result["pairs"] == 1
    assert [r["tracing"] for r in result["rounds"]] == ["off", "on"]
    assert all(r["seconds"] > 0 and r["output_tokens_per_s"] > 0 for r in result["rounds"])
    for key in ("off_output_tokens_per_s", "on_output_tokens_per_s", "ratio"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    assert result["ratio"] == result["on_output_tokens_per_s"] / result["off_output_tokens_per_s"]
    assert result["meets_target"] == (result["ratio"] >= result["target_ratio_min"] == 0.97)
    exported = result["exported"]
    assert exported["posts"] >= 1 and exported["bytes"] > 0
    traced_requests = 2 * result["num_requests"]  # the on-mode's warm-up round and its measured round
    by_name = exported["spans_by_name"]
    for name in ("pagewise.execute", "pagewise.schedule", "pagewise.decode", "pagewise.persist"):
        assert by_name[name] == traced_requests, name
    assert by_name["pagewise.prefill"] >= traced_requests
    assert by_name["pagewise.quota.reconcile"] == traced_requests
    assert exported["spans"] == sum(by_name.values())
