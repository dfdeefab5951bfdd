"""``dtype=auto`` where the CPU multiplies bf16 natively: projections and KV cache in bf16, the rest in fp32. Held
to HF transformers run in bf16 on the same prompts by vLLM's ``check_logprobs_close`` rule: up to the first position
where the two greedy sequences differ they are equal, and there each one's token is among the other's top-5
log-probabilities (after it the sequences have diverged and are not compared). The CPU's capability is
patched in, so the bf16 path runs — emulated where the CPU lacks bf16 instructions — on every machine; tiny
random models with prefix caching, chunked prefill and preemption, and the real SmolLM2."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine import config as engine_config
from pagewise.engine.config import EngineConfig, Precision
from pagewise.engine.model_runner import KVCache

BLOCK = 8
MAX_TOKENS = 16
TOP = 5

Scored = list[tuple[int, dict[int, float]]]  # per generated position: the token, and the top-5 log-probs


@pytest.fixture
def native_bf16(monkeypatch):
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)


def test_auto_is_bf16_projections_only_where_the_cpu_has_them(monkeypatch) -> None:
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)
    assert EngineConfig().resolve_precision() == Precision(torch.float32, torch.bfloat16, torch.bfloat16)
    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: False)
    assert EngineConfig().resolve_precision() == Precision.uniform(torch.float32)
    assert EngineConfig(dtype="bfloat16").resolve_precision() == Precision.uniform(torch.bfloat16)
    assert EngineConfig(dtype="float32").resolve_precision().describe() == {
        "model": "float32",
        "matmul": "float32",
        "kv_cache": "float32",
    }


def first_divergence(ours: Scored, theirs: Scored) -> str | None:
    """None when the two sequences satisfy the rule, else what broke it."""
    for position, ((mine, my_top), (hf, hf_top)) in enumerate(zip(ours, theirs, strict=True)):
        if mine == hf:
            continue
        if mine not in hf_top or hf not in my_top:
            return f"position {position}: ours {mine} (HF top-5 {sorted(hf_top)}), HF {hf} (ours {sorted(my_top)})"
        return None
    return None


def hf_scored(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> Scored:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    scored = []
    for token, logits in zip(tokens, out.logits, strict=True):
        top = torch.log_softmax(logits[0].float(), dim=-1).topk(TOP)
        scored.append((token, dict(zip(top.indices.tolist(), top.values.tolist(), strict=True))))
    return scored


def engine_scored(llm: LLM, prompts: list[list[int]], max_tokens: int, lora_request=None) -> list[Scored]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP)
    results = []
    for output in llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request):
        completion = output.outputs[0]
        results.append(
            [
                (token, {t: lp.logprob for t, lp in sorted(step.items(), key=lambda kv: -kv[1].logprob)[:TOP]})
                for token, step in zip(completion.token_ids, completion.logprobs, strict=True)
            ]
        )
    return results


def assert_close_to_hf(ours: list[Scored], theirs: list[Scored]) -> None:
    broken = {i: why for i, (o, t) in enumerate(zip(ours, theirs, strict=True)) if (why := first_divergence(o, t))}
    assert not broken, broken


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(3, 49152) for _ in range(3 * BLOCK)]  # three full blocks: a prefix-cache hit
    lengths = [1, BLOCK - 1, BLOCK + 1, 2 * BLOCK, 45, 90]
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in lengths] + [shared + [5, 6], shared + [7, 8, 9]]


@pytest.fixture(scope="module")
def tiny_bf16(tiny_model):
    path, model = tiny_model("bf16-llama-gqa", num_attention_heads=4, num_key_value_heads=2)
    reference = copy.deepcopy(model).to(torch.bfloat16).eval()
    expected = [hf_scored(reference, p, MAX_TOKENS) for p in tiny_prompts()]
    per_block = KVCache.bytes_per_block(2, BLOCK, 2, 16, torch.bfloat16)
    return path, expected, per_block


@pytest.mark.parametrize(
    "setting",
    [
        dict(),
        dict(max_num_batched_tokens=16),  # chunked prefill: the 90-token prompt in six chunks
        dict(kv_cache_memory_bytes=20),  # (in blocks) preempted and recomputed
        dict(enable_prefix_caching=False),
    ],
    ids=["plain", "chunked-prefill", "preemption", "no-prefix-cache"],
)
def test_tiny_model_in_bf16_is_close_to_hf_in_bf16(native_bf16, tiny_bf16, setting: dict) -> None:
    path, expected, per_block = tiny_bf16
    args = dict(setting)
    if "kv_cache_memory_bytes" in args:
        args["kv_cache_memory_bytes"] *= per_block
    llm = LLM(str(path), block_size=BLOCK, progress=False, **args)
    assert llm.stats()["precision"] == {"model": "float32", "matmul": "bfloat16", "kv_cache": "bfloat16"}
    prompts = tiny_prompts()
    assert_close_to_hf(engine_scored(llm, prompts, MAX_TOKENS), expected)
    if "kv_cache_memory_bytes" in setting:
        assert llm.stats()["num_preemptions"] > 0
    elif setting.get("enable_prefix_caching", True):
        # the shared prefix, computed again after its first request: answered from the cache, still close
        again = engine_scored(llm, prompts[-2:], MAX_TOKENS)
        assert llm.stats()["prefix_cache_hits"] > 0
        assert_close_to_hf(again, expected[-2:])


PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
]


def test_smollm2_in_bf16_is_close_to_hf_in_bf16(native_bf16, hf_smollm2) -> None:
    llm = LLM(progress=False)
    tok = llm.tokenizer
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    prompts = [tok.encode(p) for p in PLAIN] + [tok.apply_chat_template(chat)]
    reference = copy.deepcopy(hf_smollm2).to(torch.bfloat16).eval()
    expected = [hf_scored(reference, p, 24) for p in prompts]
    assert_close_to_hf(engine_scored(llm, prompts, 24), expected)
