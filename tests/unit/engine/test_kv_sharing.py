"""KV sharing and memory pressure never change an answer: greedy equals HF transformers and seeded sampling
gives the same tokens with prefix caching on or off, any token budget (chunked prefill), and recompute or swap
preemption under a tiny KV budget. Prefix caching hits what it should (tenant-salted, resettable); n > 1 forks
share the prompt's blocks."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from pagewise import LLM, RequestOutput, SamplingParams
from pagewise.engine.llm_engine import LLMEngine
from pagewise.engine.model_runner import KVCache

BLOCK = 4
NUM_BLOCKS = 256
TINY_BLOCKS = 12  # holds the longest request (30 + 10 tokens = 10 blocks), far from the whole batch (42 blocks)
MAX_TOKENS = 10
VOCAB = 49152
LENGTHS = [1, 3, 4, 5, 8, 9, 17, 30]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPTS = [_prompt(n, 100 + i) for i, n in enumerate(LENGTHS)]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
SEEDED = [SamplingParams(temperature=0.8, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
          for i in range(len(PROMPTS))]

MODES = {
    "default": {},
    "no-prefix-caching": dict(enable_prefix_caching=False),
    "budget-8": dict(max_num_batched_tokens=8),
    "budget-16": dict(max_num_batched_tokens=16),
    "budget-64": dict(max_num_batched_tokens=64),
    "budget-unlimited": dict(max_num_batched_tokens=None),
    "recompute-tiny-kv": dict(preemption_mode="recompute", blocks=TINY_BLOCKS),
    "swap-tiny-kv": dict(preemption_mode="swap", blocks=TINY_BLOCKS, swap_blocks=64),
    "recompute-tiny-kv-budget-8-no-caching": dict(preemption_mode="recompute", blocks=TINY_BLOCKS,
                                                  max_num_batched_tokens=8, enable_prefix_caching=False),
    "swap-space-too-small-falls-back-to-recompute": dict(preemption_mode="swap", blocks=TINY_BLOCKS, swap_blocks=3),
    "swap-tiny-kv-budget-16": dict(preemption_mode="swap", blocks=TINY_BLOCKS, swap_blocks=64,
                                   max_num_batched_tokens=16),
}


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("kv-sharing-llama")


@pytest.fixture(scope="module")
def per_block(tiny) -> int:
    cfg = tiny[1].config
    return KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads,
                                   cfg.hidden_size // cfg.num_attention_heads, torch.float32)


@pytest.fixture(scope="module")
def make_llm(tiny, per_block):
    def make(blocks: int = NUM_BLOCKS, swap_blocks: int = 0, **engine_args) -> LLM:
        return LLM(str(tiny[0]), block_size=BLOCK, kv_cache_memory_bytes=blocks * per_block,
                   swap_space_bytes=swap_blocks * per_block, progress=False, **({"dtype": "float32"} | engine_args))

    return make


def hf_greedy(model, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def hf_expected(tiny) -> list[list[int]]:
    return [hf_greedy(tiny[1], p) for p in PROMPTS]


_ids = itertools.count()


def drive(engine: LLMEngine, prompts, params, tenant_id=None) -> tuple[list[RequestOutput], dict]:
    """Run requests to completion with ``step()``; returns outputs in order and the peaks seen between steps."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [f"kv-{next(_ids)}" for _ in prompts]
    for request_id, prompt, p in zip(ids, prompts, params, strict=True):
        engine.add_request(request_id, prompt, p, tenant_id)
    done: dict[str, RequestOutput] = {}
    peaks = {"num_requests_swapped": 0, "blocks_in_use": 0}
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        stats = engine.stats()
        peaks["num_requests_swapped"] = max(peaks["num_requests_swapped"], stats["num_requests_swapped"])
        peaks["blocks_in_use"] = max(peaks["blocks_in_use"], stats["kv_blocks_total"] - stats["kv_blocks_free"])
    else:
        pytest.fail("requests did not finish within 10,000 steps")
    return [done[i] for i in ids], peaks


def token_ids(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == stats["num_requests_swapped"] == 0


@pytest.fixture(scope="module")
def seeded_baseline(make_llm) -> list[list[int]]:
    llm = make_llm()
    outputs, _ = drive(llm.engine, PROMPTS, SEEDED)
    return token_ids(outputs)


# ---- same answers in every mode


@pytest.mark.parametrize("mode", list(MODES))
def test_same_tokens_in_every_mode(make_llm, hf_expected, seeded_baseline, mode) -> None:
    llm = make_llm(**MODES[mode])
    greedy, peaks = drive(llm.engine, PROMPTS, GREEDY)
    assert token_ids(greedy) == hf_expected
    assert all(o.outputs[0].finish_reason == "length" for o in greedy)
    stats = llm.stats()
    if "blocks" in MODES[mode]:
        assert stats["num_preemptions"] > 0
    if MODES[mode].get("swap_blocks", 0) > 10:
        assert stats["num_swapped_out_blocks"] > 0
        assert peaks["num_requests_swapped"] > 0
    assert_all_free(llm)
    sampled, _ = drive(llm.engine, PROMPTS, SEEDED)
    assert token_ids(sampled) == seeded_baseline
    assert_all_free(llm)


def test_seeded_samples_are_not_all_greedy(seeded_baseline, hf_expected) -> None:
    """The seeded comparison above is meaningful: temperature 0.8 samples leave the greedy path."""
    assert sum(s != g for s, g in zip(seeded_baseline, hf_expected, strict=True)) >= len(PROMPTS) // 2


# ---- prefix caching


LONG = _prompt(42, 7)
LONG_CACHED = (len(LONG) - 1) // BLOCK * BLOCK  # full blocks before the last prompt token: 40


def generate_one(llm: LLM, prompt, tenant_id=None) -> RequestOutput:
    (out,) = llm.generate([prompt], GREEDY, tenant_id=tenant_id, use_tqdm=False)
    return out


def test_same_prompt_twice_hits_the_prefix_cache(make_llm, tiny) -> None:
    llm = make_llm()
    first = generate_one(llm, LONG)
    s1 = llm.stats()
    second = generate_one(llm, LONG)
    s2 = llm.stats()
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == LONG_CACHED == 40
    assert s2["prefix_cache_hits"] - s1["prefix_cache_hits"] == LONG_CACHED
    assert s2["prefix_cache_queries"] - s1["prefix_cache_queries"] == len(LONG)
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == hf_greedy(tiny[1], LONG)
    assert_all_free(llm)


def test_shared_prefix_hits_only_the_shared_full_blocks(make_llm, tiny) -> None:
    llm = make_llm()
    generate_one(llm, LONG)
    other = LONG[:22] + _prompt(9, 8)  # shares 5 full blocks and 2 tokens of the 6th
    out = generate_one(llm, other)
    assert out.num_cached_tokens == 20
    assert out.outputs[0].token_ids == hf_greedy(tiny[1], other)


def test_blocks_filled_during_decode_are_cached(make_llm) -> None:
    llm = make_llm()
    prompt = _prompt(10, 9)
    out = generate_one(llm, prompt)
    follow_up = prompt + out.outputs[0].token_ids[:8]  # 18 tokens: 4 full blocks, the last two filled by decode
    assert generate_one(llm, follow_up).num_cached_tokens == 16


def test_prompt_of_exactly_full_blocks_recomputes_its_last_block(make_llm) -> None:
    llm = make_llm()
    prompt = _prompt(4 * BLOCK, 10)
    generate_one(llm, prompt)
    assert generate_one(llm, prompt).num_cached_tokens == 3 * BLOCK


def test_tenants_never_share_prefixes(make_llm) -> None:
    llm = make_llm()
    results = [(tenant, generate_one(llm, LONG, tenant)) for tenant in ["a", "b", "a", None, None, "b", "c"]]
    assert [(t, o.num_cached_tokens) for t, o in results] == [
        ("a", 0), ("b", 0), ("a", LONG_CACHED), (None, 0), (None, LONG_CACHED), ("b", LONG_CACHED), ("c", 0)
    ]
    assert len({tuple(o.outputs[0].token_ids) for _, o in results}) == 1


def test_reset_prefix_cache(make_llm) -> None:
    llm = make_llm()
    assert generate_one(llm, LONG).num_cached_tokens == 0
    assert generate_one(llm, LONG).num_cached_tokens == LONG_CACHED
    llm.reset_prefix_cache()
    hits = llm.stats()["prefix_cache_hits"]
    assert generate_one(llm, LONG).num_cached_tokens == 0
    assert llm.stats()["prefix_cache_hits"] == hits
    assert generate_one(llm, LONG).num_cached_tokens == LONG_CACHED


def test_no_hits_with_prefix_caching_off(make_llm) -> None:
    llm = make_llm(enable_prefix_caching=False)
    assert [generate_one(llm, LONG).num_cached_tokens for _ in range(2)] == [0, 0]
    assert llm.stats()["prefix_cache_hits"] == 0


# ---- n > 1: one prefill, forks share the prompt's blocks


@pytest.mark.parametrize("length", [64, 66])
def test_parallel_sampling_allocates_the_prompt_once(make_llm, length) -> None:
    llm = make_llm()
    engine = llm.engine
    n, max_tokens = 8, 6
    prompt = _prompt(length, 11)
    params = SamplingParams(n=n, temperature=0.8, seed=500, max_tokens=max_tokens, ignore_eos=True)

    def in_use() -> int:
        stats = engine.stats()
        return stats["kv_blocks_total"] - stats["kv_blocks_free"]

    engine.add_request("fork", prompt, params)
    assert in_use() == 0
    engine.step()  # the whole prompt in one step, then 8 samples from its logits
    prompt_blocks = math.ceil(length / BLOCK)
    samples = [s.request for s in engine._groups["fork"].samples]
    assert len({tuple(r.block_ids) for r in samples}) == 1
    assert in_use() == prompt_blocks
    engine.step()  # every sample writes its first token: a new block each, or a copy of the shared partial one
    assert in_use() == prompt_blocks + (n if length % BLOCK == 0 else n - 1)
    assert in_use() < n * prompt_blocks
    final = None
    while engine.has_unfinished_requests():
        final = next((o for o in engine.step() if o.finished), final)
    assert final is not None and [c.index for c in final.outputs] == list(range(n))
    assert engine.peak_blocks_in_use == length // BLOCK + n * (math.ceil((length + max_tokens - 1) / BLOCK)
                                                                - length // BLOCK)
    assert_all_free(llm)
    # Each forked sample equals the same sample run alone (seed + index): copy-on-write kept every KV intact.
    alone = llm.generate([prompt] * n, [SamplingParams(temperature=0.8, seed=500 + i, max_tokens=max_tokens,
                                                       ignore_eos=True) for i in range(n)], use_tqdm=False)
    assert [c.token_ids for c in final.outputs] == token_ids(alone)
    assert len({tuple(c.token_ids) for c in final.outputs}) > 1
    assert_all_free(llm)


def test_parallel_greedy_samples_equal_hf(make_llm, tiny) -> None:
    llm = make_llm(max_num_batched_tokens=16)  # chunked prefill, then the fork
    prompt = _prompt(23, 12)
    (out,) = llm.generate([prompt], SamplingParams(n=8, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True),
                          use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [hf_greedy(tiny[1], prompt)] * 8
    assert_all_free(llm)


def test_parallel_sampling_under_preemption(make_llm, seeded_baseline) -> None:
    """n = 4 forks of two prompts in a KV budget that cannot hold them all: samples equal their seeds' solo runs."""
    prompts = [PROMPTS[6], PROMPTS[7]]
    params = SamplingParams(n=4, temperature=0.8, seed=77, max_tokens=MAX_TOKENS, ignore_eos=True)
    solo = make_llm()
    expected = [[token_ids(solo.generate([p], SamplingParams(temperature=0.8, seed=77 + i, max_tokens=MAX_TOKENS,
                                                              ignore_eos=True), use_tqdm=False))[0]
                 for i in range(4)] for p in prompts]
    for mode in ("recompute", "swap"):
        llm = make_llm(blocks=TINY_BLOCKS + 4, swap_blocks=64, preemption_mode=mode)
        outputs, _ = drive(llm.engine, prompts, params)
        assert [[c.token_ids for c in o.outputs] for o in outputs] == expected, mode
        assert llm.stats()["num_preemptions"] > 0, mode
        assert_all_free(llm)


# ---- aborts in every state under memory pressure


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_aborts_while_swapped_waiting_or_prefilling(make_llm, hf_expected, mode) -> None:
    llm = make_llm(blocks=TINY_BLOCKS, swap_blocks=64, preemption_mode=mode, max_num_batched_tokens=8)
    engine = llm.engine
    ids = [f"ab-{i}" for i in range(len(PROMPTS))]
    for request_id, prompt in zip(ids, PROMPTS, strict=True):
        engine.add_request(request_id, prompt, GREEDY)
    aborted: dict[str, str] = {}
    done: dict[str, RequestOutput] = {}
    sched = engine.scheduler
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        running_prefill = [r for r in sched.running if r.num_computed_tokens < r.num_prompt_tokens]
        candidates = {
            "swapped": list(sched.swapped),
            "preempted": [r for r in sched.waiting if r.num_output_tokens > 0],
            "prefilling": running_prefill,
        }
        for state, requests in candidates.items():
            if state not in aborted.values() and requests and len(aborted) < 3:
                victim = requests[0].group_id
                if victim not in aborted:
                    engine.abort_request(victim)
                    aborted[victim] = state
    else:
        pytest.fail("requests did not finish")
    assert "prefilling" in aborted.values()
    assert ("swapped" if mode == "swap" else "preempted") in aborted.values()
    for request_id, want in zip(ids, hf_expected, strict=True):
        if request_id not in aborted:
            assert done[request_id].outputs[0].token_ids == want, request_id
    assert not set(aborted) & set(done)
    assert_all_free(llm)
    assert len(engine.kv.swap.free_slots) == engine.kv.swap.num_slots
    assert all(b.ref_count == 0 for b in engine.pool.blocks)
