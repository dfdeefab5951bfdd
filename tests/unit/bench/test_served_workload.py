"""The served loads' workloads: the first load sends the offline requests; each later load has prompts of its own."""

from __future__ import annotations

from pagewise.bench.served_workload import OUTPUT_RANGE, PROMPT_RANGE, phase_workloads
from pagewise.bench.throughput import make_workload

VOCAB = 49152


def test_each_later_load_has_fresh_prompts_of_the_same_lengths() -> None:
    workload = make_workload(16, PROMPT_RANGE, OUTPUT_RANGE, VOCAB)
    phases = phase_workloads(workload, 3, VOCAB)
    assert phases[0] is workload
    for phase in phases:
        assert [len(p) for p in phase.prompts] == [len(p) for p in workload.prompts]
        assert phase.output_lens == workload.output_lens
        assert all(0 <= t < VOCAB for p in phase.prompts for t in p)
    first_blocks = [{tuple(p[:16]) for p in phase.prompts} for phase in phases]
    assert all(len(blocks) == 16 for blocks in first_blocks)  # no two prompts of a load share a first block
    assert not first_blocks[0] & first_blocks[1] and not first_blocks[1] & first_blocks[2]  # nor two loads
    again = phase_workloads(workload, 3, VOCAB)
    assert [p.prompts for p in again] == [p.prompts for p in phases]  # every run and server sees the same
