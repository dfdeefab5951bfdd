"""The engine's own record of each request (milestones and lifecycle events on its outputs) and its latency
histograms, on a tiny random model: milestones in order, each histogram counting exactly what vLLM counts,
scheduling / prefill-chunk / preemption events that add up to the work done, and deltas that hand each event
over once."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest
import torch

from pagewise import LLM, RequestOutput, SamplingParams
from pagewise.engine.llm_engine import LLMEngine
from pagewise.engine.model_runner import KVCache
from pagewise.engine.outputs import Preempted, PrefillChunk, RequestEvent, Resumed, Scheduled
from pagewise.engine.request_metrics import Histogram, HistogramSnapshot

BLOCK = 4
TINY_BLOCKS = 12  # holds the longest request (30 + 10 tokens = 10 blocks), far from the whole batch
MAX_TOKENS = 10
LENGTHS = [1, 3, 4, 5, 8, 9, 17, 30]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


PROMPTS = [_prompt(n, 300 + i) for i, n in enumerate(LENGTHS)]
_ids = itertools.count()


@pytest.fixture(scope="module")
def make_engine(tiny_model):
    path, model = tiny_model("request-metrics-llama")
    cfg = model.config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
        torch.float32,
    )

    def make(blocks: int = 256, swap_blocks: int = 0, **engine_args) -> LLMEngine:
        llm = LLM(str(path), block_size=BLOCK, kv_cache_memory_bytes=blocks * per_block,
                  swap_space_bytes=swap_blocks * per_block, progress=False, **({"dtype": "float32"} | engine_args))
        return llm.engine

    return make


def drive(engine: LLMEngine, prompts: list[list[int]], *, delta: bool = False, tenant_id: str | None = None):
    """Run requests to completion; returns (final outputs in order, every output of each request in order)."""
    ids = [f"m-{next(_ids)}" for _ in prompts]
    for request_id, prompt in zip(ids, prompts, strict=True):
        engine.add_request(request_id, prompt, GREEDY, tenant_id, delta=delta)
    seen: dict[str, list[RequestOutput]] = {i: [] for i in ids}
    while engine.has_unfinished_requests():
        for output in engine.step():
            seen[output.request_id].append(output)
    assert all(outputs[-1].finished for outputs in seen.values())
    return [seen[i][-1] for i in ids], [seen[i] for i in ids]


def _timeless(event: RequestEvent) -> tuple:
    fields = dataclasses.asdict(event)
    return type(event).__name__, *(v for k, v in fields.items() if k not in ("time", "start", "end"))


def _of(events: list[RequestEvent], kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def test_a_histogram_counts_a_value_in_the_first_bucket_whose_bound_it_does_not_exceed() -> None:
    histogram = Histogram((1.0, 2.0))
    for value in (0.5, 1.0, 1.5, 2.0, 7.0):
        histogram.observe(value)
    assert histogram.snapshot() == HistogramSnapshot((1.0, 2.0), (2, 2, 1), 12.0)
    assert histogram.snapshot().count == 5


def test_milestones_are_in_order_and_each_histogram_counts_what_vllm_counts(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=8)  # chunked prefill: several steps between scheduling and token
    finals, _ = drive(engine, PROMPTS)
    metrics = [o.metrics for o in finals]
    for m in metrics:
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.num_preemptions == 0
    assert any(m.first_token_time > m.first_scheduled_time for m in metrics)
    stats = engine.stats()
    expected = {
        "time_to_first_token_seconds": [m.first_token_time - m.arrival_time for m in metrics],
        "e2e_request_latency_seconds": [m.finished_time - m.arrival_time for m in metrics],
        "request_queue_time_seconds": [m.first_scheduled_time - m.arrival_time for m in metrics],
        "request_prefill_time_seconds": [m.first_token_time - m.first_scheduled_time for m in metrics],
        "request_decode_time_seconds": [m.finished_time - m.first_token_time for m in metrics],
    }
    for name, values in expected.items():
        snapshot: HistogramSnapshot = stats[name]
        assert snapshot.count == len(PROMPTS), name
        assert snapshot.sum == pytest.approx(sum(values)), name
        cumulative = list(itertools.accumulate(snapshot.counts))
        assert cumulative[:-1] == [sum(v <= bound for v in values) for bound in snapshot.bounds], name
    itl = stats["inter_token_latency_seconds"]
    assert itl.count == len(PROMPTS) * (MAX_TOKENS - 1)  # every token after each request's first
    assert itl.sum == pytest.approx(sum(m.finished_time - m.first_token_time for m in metrics))
    iteration = stats["iteration_tokens_total"]
    assert iteration.count == engine.metrics.num_steps
    assert iteration.sum == sum(LENGTHS) + len(PROMPTS) * (MAX_TOKENS - 1)  # prompts, then one input per decode
    assert sum(iteration.counts[:2]) == iteration.count  # no step computed more than its budget of 8


def test_a_chunked_prefill_is_one_scheduling_then_one_event_per_chunk(make_engine) -> None:
    engine = make_engine(max_num_batched_tokens=8)
    [final], _ = drive(engine, [PROMPTS[-1]])  # 30 tokens
    scheduled, *chunks = final.events
    assert scheduled == Scheduled(scheduled.time, 1, 0, 2)  # admitted in step 1 with 2 blocks for its 8 tokens
    assert [(c.step, c.num_tokens, c.recompute, c.sample) for c in chunks] == [
        (1, 8, False, 0), (2, 8, False, 0), (3, 8, False, 0), (4, 6, False, 0)
    ]
    assert final.metrics.first_scheduled_time == scheduled.time == chunks[0].start
    for before, after in itertools.pairwise(chunks):
        assert before.start < before.end <= after.start
    assert final.metrics.first_token_time == chunks[-1].end


def test_a_prefix_hit_shows_at_scheduling_and_shortens_the_prefill(make_engine) -> None:
    engine = make_engine()
    prompt = PROMPTS[6]  # 17 tokens: 4 full blocks
    drive(engine, [prompt], tenant_id="a")
    [again], _ = drive(engine, [prompt], tenant_id="a")
    [other], _ = drive(engine, [prompt], tenant_id="b")
    assert [(e.cached_tokens, e.num_blocks) for e in _of(again.events, Scheduled)] == [(16, 5)]
    assert [c.num_tokens for c in _of(again.events, PrefillChunk)] == [1]
    assert [(e.cached_tokens, e.num_blocks) for e in _of(other.events, Scheduled)] == [(0, 5)]
    assert [c.num_tokens for c in _of(other.events, PrefillChunk)] == [17]


def _check_preemptions(finals: list[RequestOutput], mode: str) -> int:
    """Each preemption is followed by one resumption in the same mode; a recompute's chunks cover the tokens the
    sample had when it resumed (its prompt and 1..MAX_TOKENS-1 generated ones), less the prefix hit. Returns the
    number of preemptions."""
    total = 0
    for output in finals:
        events = output.events
        preempted, resumed = _of(events, Preempted), _of(events, Resumed)
        assert output.metrics.num_preemptions == len(preempted) == len(resumed)
        assert all(e.mode == mode for e in preempted + resumed)
        assert [c.num_tokens for c in _of(events, PrefillChunk) if not c.recompute] == [len(output.prompt_token_ids)]
        for p, r in zip(preempted, resumed, strict=True):
            assert p.step < r.step and p.time <= r.time
            assert events.index(p) < events.index(r)
            rest = events[events.index(r) + 1 :]
            upto = next((i for i, e in enumerate(rest) if isinstance(e, Preempted)), len(rest))
            recomputed = sum(c.num_tokens for c in _of(rest[:upto], PrefillChunk) if c.recompute)
            if mode == "swap":
                assert recomputed == r.cached_tokens == 0
            else:
                assert 1 <= r.cached_tokens + recomputed - len(output.prompt_token_ids) < MAX_TOKENS
        total += len(preempted)
    return total


def test_recompute_preemptions_are_events_with_the_recomputed_prefill(make_engine) -> None:
    engine = make_engine(blocks=TINY_BLOCKS, preemption_mode="recompute")
    finals, _ = drive(engine, PROMPTS)
    assert _check_preemptions(finals, "recompute") == engine.stats()["num_preemptions"] > 0
    assert any(c.recompute for o in finals for c in _of(o.events, PrefillChunk))


def test_swap_preemptions_are_events_without_a_prefill(make_engine) -> None:
    engine = make_engine(blocks=TINY_BLOCKS, swap_blocks=64, preemption_mode="swap")
    finals, _ = drive(engine, PROMPTS)
    assert _check_preemptions(finals, "swap") == engine.stats()["num_preemptions"] > 0


def test_deltas_hand_over_each_event_once_in_order(make_engine) -> None:
    """Scheduling is deterministic, so a delta run and a cumulative run of one workload have the same events."""
    finals, _ = drive(make_engine(blocks=TINY_BLOCKS, max_num_batched_tokens=8), PROMPTS)
    _, deltas = drive(make_engine(blocks=TINY_BLOCKS, max_num_batched_tokens=8), PROMPTS, delta=True)
    for final, outputs in zip(finals, deltas, strict=True):
        handed_over = [e for output in outputs for e in output.events]
        assert [_timeless(e) for e in handed_over] == [_timeless(e) for e in final.events]
        assert outputs[-1].metrics.num_preemptions == final.metrics.num_preemptions
    assert any(_of(final.events, Preempted) for final in finals)
