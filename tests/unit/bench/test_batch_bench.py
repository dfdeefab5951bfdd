"""`pagewise bench batch --quick --json` end to end on the real default model, through a real server: one JSON
object with every phase's figures present and sane. The targets are the bench's to report, not this test's."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


def test_bench_batch_quick_json() -> None:
    command = [sys.executable, "-m", "pagewise.cli", "bench", "batch", "--quick", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.strip().splitlines()
    result = json.loads(line)
    for phase in ("solo", "batch"):
        figures = result[phase]
        assert figures["requests"] > 0
        assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
        assert figures["processed_tokens_per_s"] > 0
    assert result["full_load"]["processed_tokens_per_s"] > result["solo"]["processed_tokens_per_s"]
    # the batch's lines ran during the window: the engine processed far more than the interactive requests alone
    # (whether any line also finished inside the quick bench's 4 s depends on the CPU's speed)
    assert result["batch"]["processed_tokens_per_s"] > 2 * result["solo"]["processed_tokens_per_s"]
    counts = result["batch"]["request_counts_at_end"]
    assert counts["total"] == result["workload"]["lines"] and counts["failed"] == 0
    for phase in ("solo", "batch"):
        parts = result["interactive_ttft_parts"][phase]
        assert 0 < parts["engine_p50_ms"] < result[phase]["ttft_p99_ms"] and parts["hand_over_p50_ms"] >= 0
    assert result["interactive_ttft_p99_ratio"] > 0 and math.isfinite(result["batch_share_of_spare"])
    assert isinstance(result["meets_targets"], bool)
