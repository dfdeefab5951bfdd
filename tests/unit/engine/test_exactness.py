"""Greedy outputs equal HF transformers' greedy ``generate`` token for token (fp32, CPU) on tiny random models
covering GQA ratios 1 and > 1, qkv bias, untied embeddings and a non-default RoPE theta, with prompts of many
lengths batched together — and under a KV budget so small that requests are preempted."""

from __future__ import annotations

import random

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine.model_runner import KVCache
from pagewise.kernels.gemm import GemmPath, supported_paths

BLOCK = 8
MAX_TOKENS = 12

VARIANTS = {
    "llama-gqa": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2),
    "llama-mha-untied-theta": dict(
        model_type="llama",
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "qwen2-bias": dict(
        model_type="qwen2", num_attention_heads=4, num_key_value_heads=1, rope_theta=1000000.0
    ),
    "mistral-gqa": dict(
        model_type="mistral", num_attention_heads=8, num_key_value_heads=2, head_dim=16, sliding_window=None
    ),
}


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK, 3 * BLOCK + 5, 57, 100]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def oracle(tiny_model):
    cache: dict[str, list[list[int]]] = {}

    def expected(variant: str) -> tuple:
        path, model = tiny_model(variant, **VARIANTS[variant])
        if variant not in cache:
            cache[variant] = [hf_greedy(model, p, MAX_TOKENS) for p in prompts()]
        return path, model, cache[variant]

    return expected


def greedy(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf(oracle, variant: str) -> None:
    path, _, expected = oracle(variant)
    llm = LLM(str(path), block_size=BLOCK, progress=False, dtype="float32")
    assert greedy(llm, prompts()) == expected
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_greedy_matches_hf_under_preemption(oracle, variant: str) -> None:
    path, model, expected = oracle(variant)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, head_dim, torch.float32
    )
    # 20 blocks hold the longest request (100 + 12 tokens = 14 blocks) but not the whole batch at once.
    llm = LLM(str(path), block_size=BLOCK, kv_cache_memory_bytes=20 * per_block, progress=False, dtype="float32")
    assert greedy(llm, prompts()) == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("variant", ["llama-gqa"])
def test_greedy_matches_hf_under_fair_scheduling(oracle, variant: str) -> None:
    """Three tenants with different weights, under memory pressure: the fair policy reorders and preempts by
    tenant, and every output still equals HF's."""
    path, model, expected = oracle(variant)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, head_dim, torch.float32
    )
    llm = LLM(
        str(path), block_size=BLOCK, kv_cache_memory_bytes=20 * per_block, scheduling_policy="fair",
        max_num_batched_tokens=16, progress=False, dtype="float32"
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, prompt in enumerate(prompts()):
        engine.add_request(f"r{i}", prompt, params, tenant_id=f"t{i % 3}", tenant_weight=1.0 + i % 3)
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    assert [outputs[f"r{i}"] for i in range(len(expected))] == expected
    assert llm.stats()["num_preemptions"] > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("gemm_path", supported_paths(torch.device("cpu"), torch.float32))
@pytest.mark.parametrize("variant", ["llama-gqa", "qwen2-bias"])
def test_greedy_matches_hf_on_every_gemm_path(oracle, variant: str, gemm_path: GemmPath) -> None:
    """Every matmul path this machine offers, forced, gives HF's tokens (the bias variant covers a packed
    projection with a bias)."""
    path, _, expected = oracle(variant)
    llm = LLM(str(path), block_size=BLOCK, gemm_path=gemm_path.value, progress=False, dtype="float32")
    assert llm.stats()["gemm_path"] == gemm_path.value
    assert greedy(llm, prompts()) == expected


@pytest.mark.parametrize(
    ("policy", "preemption_mode"), [("fcfs", "recompute"), ("fair", "swap"), ("fair", "recompute")]
)
def test_greedy_matches_hf_with_interrupts_at_every_layer(oracle, policy: str, preemption_mode: str) -> None:
    """Every step is paused at every layer for an interrupting step of whatever is outside it (the test switch),
    under chunked prefill (16-token steps), memory pressure (preemption by swap or recompute) and, on a second
    pass over the same prompts, prefix-cache hits: every output still equals HF's."""
    path, model, expected = oracle("llama-gqa")
    cfg = model.config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
        torch.float32,
    )
    llm = LLM(
        str(path), block_size=BLOCK, kv_cache_memory_bytes=20 * per_block, scheduling_policy=policy,
        preemption_mode=preemption_mode, max_num_batched_tokens=16, force_step_interrupts=True,
        interrupt_max_num_batched_tokens=4, progress=False, dtype="float32",
    )
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for round_ in range(2):
        for i, prompt in enumerate(prompts()):
            engine.add_request(f"{round_}-{i}", prompt, params, tenant_id=f"t{i % 2}")
        outputs = {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
        assert [outputs[f"{round_}-{i}"] for i in range(len(expected))] == expected
        assert_all_blocks_free(llm)
    stats = llm.stats()
    assert stats["step_interrupts"] > 0 and stats["steps_paused"] > 0
    assert stats["num_preemptions"] > 0
    assert stats["prefix_cache_hits"] > 0
