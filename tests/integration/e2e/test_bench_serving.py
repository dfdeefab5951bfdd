"""`pagewise bench serving --json` end to end with tiny settings: it starts its own server, drives it, and
prints one JSON object with positive figures; once with a fixed number of requests, once for a duration."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

LATENCIES = [f"{name}_p{q}_ms" for name in ("ttft", "tpot", "itl", "e2e") for q in (50, 90, 99)]


def _bench(*options: str) -> tuple[dict[str, Any], str]:
    """(the JSON result, stderr) of one `pagewise bench serving --json --max-model-len 512 ...` run."""
    command = [sys.executable, "-m", "pagewise.cli", "bench", "serving", "--json", "--max-model-len", "512"]
    done = subprocess.run(
        [*command, *options], capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3]
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.strip().splitlines()  # stdout is the JSON object alone; progress went to stderr
    return json.loads(line), done.stderr


def _assert_load_figures(result: dict[str, Any]) -> None:
    assert (result["num_errors"], result["errors"]) == (0, [])
    assert result["num_completed"] == result["num_requests"]
    assert result["output_tokens"] == 4 * result["num_requests"]  # ignore_eos: exactly max_tokens each
    for key in ("request_throughput_per_s", "output_tokens_per_s", *LATENCIES):
        assert result[key] > 0, (key, result[key])


def test_bench_serving_fixed_requests_and_overhead() -> None:
    result, stderr = _bench(
        "--num-requests", "4", "--concurrency", "2", "--max-tokens", "4", "--overhead-requests", "4"
    )
    assert (result["num_requests"], result["duration_target_s"]) == (4, None)
    _assert_load_figures(result)
    # overhead is a difference of two noisy wall times: present and finite; positive except on a busy machine
    for key in ("overhead_p50_ms", "overhead_p99_ms"):
        assert isinstance(result[key], float) and abs(result[key]) < 60_000, (key, result[key])
    assert "overhead (API vs the engine directly" in stderr
    # the API's own hop histogram, read over the queue-hop phase: every request of it, a mean well under a second
    assert result["queue_hop_api_requests"] == result["queue_hop_requests"] + 2  # its two warm-ups count too
    assert 0 <= result["queue_hop_api_mean_ms"] < 1000 and 0 <= result["queue_hop_api_p50_ms"] < 1000


def test_bench_serving_duration_closed_loop() -> None:
    result, stderr = _bench("--duration", "3", "--concurrency", "4", "--max-tokens", "4", "--overhead-requests", "0")
    assert result["duration_target_s"] == 3
    assert result["duration_s"] >= 3  # the requests in flight at the deadline finished and counted
    assert result["num_requests"] >= 4  # every client sent at least one
    _assert_load_figures(result)
    assert "overhead_p50_ms" not in result
    assert "load: 4 concurrent clients, 4 tokens each, for 3 s" in stderr


def test_bench_serving_mixed_workload_served_against_offline() -> None:
    result, stderr = _bench(
        "--workload", "mixed", "--num-requests", "4", "--rate", "inf", "--rate", "8", "--max-model-len", "1024"
    )
    assert (result["workload"], result["num_requests"], result["num_errors"]) == ("mixed", 4, 0)
    loads = result["loads"]
    assert [load["rate"] for load in loads] == [None, 8.0]  # None: all at once
    for load in loads:
        assert load["errors"] == [] and load["output_tokens_per_s"] > 0
        for key in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms"):
            assert load[key] > 0, (key, load[key])
    assert result["offline_output_tokens_per_s"] > 0
    assert result["served_offline_ratio"] == loads[0]["output_tokens_per_s"] / result["offline_output_tokens_per_s"]
    assert "offline: 4 requests" in stderr
