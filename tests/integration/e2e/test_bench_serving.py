"""`pagewise bench serving --json` end to end with tiny settings: it starts its own server, drives it, and
prints one JSON object with positive figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KEYS = ("overhead_p50_ms", "overhead_p99_ms", "ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s")


def test_bench_serving_smoke() -> None:
    command = [
        sys.executable,
        "-m",
        "pagewise.cli",
        "bench",
        "serving",
        "--json",
        "--num-requests",
        "4",
        "--concurrency",
        "2",
        "--max-tokens",
        "4",
        "--overhead-requests",
        "4",
        "--max-model-len",
        "512",
    ]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3]
    )
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.strip().splitlines()  # stdout is the JSON object alone; progress went to stderr
    result = json.loads(line)
    assert (result["completed"], result["failed"]) == (4, 0)
    assert result["output_tokens"] == 16
    for key in ("ttft_p50_ms", "tpot_p50_ms", "output_tokens_per_s", "e2e_p99_ms", "itl_p50_ms"):
        assert result[key] > 0, (key, result[key])
    # overhead is a difference of two noisy wall times: present and finite; positive except on a busy machine
    for key in ("overhead_p50_ms", "overhead_p99_ms"):
        assert isinstance(result[key], float) and abs(result[key]) < 60_000, (key, result[key])
    assert set(KEYS) <= set(result)
    assert "overhead (API vs in-process engine" in done.stderr
