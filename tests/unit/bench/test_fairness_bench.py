"""`pagewise bench fairness --quick --json` end to end on the real default model: one JSON object on stdout with
every phase's figures present and sane. The targets (fair p99 TTFT ratio <= 1.5, throughput ratio >= 0.95) are
the bench's to report, not this test's: timings on a shared machine are too noisy to assert."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

# phase -> (policy, step interrupts, flood priority)
PHASES = {
    "solo": ("fair", True, 0),
    "flooded_fair": ("fair", True, 0),
    "solo_fcfs": ("fcfs", True, 0),
    "flooded_fcfs": ("fcfs", True, 0),
    "flooded_priority": ("fcfs", True, 1),
    "flooded_fair_no_interrupts": ("fair", False, 0),
}
RATIOS = (
    "ttft_p99_ratio_fcfs",
    "ttft_p99_ratio_fair",
    "ttft_p99_ratio_fair_no_interrupts",
    "ttft_p99_ratio_priority",
    "throughput_ratio",
    "processed_throughput_ratio",
    "processed_throughput_ratio_no_interrupts",
    "solo_ttft_p99_ratio_fcfs_to_fair",
)


def test_bench_fairness_quick_json() -> None:
    command = [sys.executable, "-m", "pagewise.cli", "bench", "fairness", "--quick", "--json"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[3])
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.strip().splitlines()  # stdout is the JSON object alone; progress went to stderr
    result = json.loads(line)
    assert "flooded_fcfs: " in done.stderr

    assert set(result["phases"]) == set(PHASES)
    for name, phase in result["phases"].items():
        policy, interrupts, priority = PHASES[name]
        assert (phase["policy"], phase["step_interrupts"], phase["flood_priority"]) == (policy, interrupts, priority)
        assert phase["flooded"] == name.startswith("flooded")
        assert phase["interrupts_per_s"] >= 0
        assert phase["quiet_requests"] > 0
        ttft = [phase[f"quiet_ttft_p{q}_ms"] for q in (50, 90, 99)]
        assert 0 < ttft[0] <= ttft[1] <= ttft[2] <= phase["quiet_ttft_max_ms"], (name, ttft)
        if phase["flooded"]:
            assert phase["flood_output_tokens_per_s"] > 0
            if phase["flood_requests_finished"]:
                assert 0 < phase["flood_tpot_p50_ms"] <= phase["flood_tpot_p99_ms"], name
        else:  # a flooded quiet request may get its tokens only after the window; a solo one does not
            assert phase["quiet_output_tokens_per_s"] > 0
            assert phase["flood_output_tokens_per_s"] == phase["flood_requests_finished"] == 0
        assert phase["processed_tokens_per_s"] > 0, name
        assert math.isclose(
            phase["output_tokens_per_s"], phase["flood_output_tokens_per_s"] + phase["quiet_output_tokens_per_s"]
        )
    for key in RATIOS:
        assert math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    assert result["ttft_p99_ratio_fair"] == (
        result["phases"]["flooded_fair"]["quiet_ttft_p99_ms"] / result["phases"]["solo"]["quiet_ttft_p99_ms"]
    )
    # the fair engine keeps a virtual token counter per tenant; FCFS keeps none
    assert set(result["served"]["fair"]) == {"flood", "quiet"}
    assert all(served > 0 for served in result["served"]["fair"].values())
    assert result["served"]["fcfs"] == {}
    assert set(result["flood_tpot_p99_ms"]) == {"interrupts", "no_interrupts"}
    assert result["phases"]["flooded_fair_no_interrupts"]["interrupts_per_s"] == 0  # none without interrupts
    assert result["phases"]["flooded_fcfs"]["interrupts_per_s"] == 0  # one class, FCFS: nobody is owed
    assert isinstance(result["meets_targets"], bool)
