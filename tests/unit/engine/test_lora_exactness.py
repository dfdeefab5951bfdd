"""Adapters: greedy outputs under a LoRA adapter equal HF transformers + PEFT (the same adapter applied with
``peft``, unmerged) token for token, on a tiny random model with random rank-8 and rank-16 adapters made here —
alone, and many adapters and the base model batched together, with fewer slots than adapters (eviction), under
preemption (recompute and swap) and chunked prefill; the prefix cache never shares KV across adapters. The real
default model (SmolLM2-135M) too, under random rank-8 and rank-16 adapters batched with the base model."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch
from test_exactness import hf_greedy as hf_greedy_n

from pagewise import LLM, LoRARequest, SamplingParams
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.model_runner import KVCache

peft = pytest.importorskip("peft")

BLOCK = 8
MAX_TOKENS = 10
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {  # name: (rank, alpha, targets, rslora)
    "r8-all": (8, 16, ALL, False),
    "r16-all": (16, 8, ALL, False),
    "r8-attn": (8, 32, ["q_proj", "v_proj"], False),
    "r16-mlp-rslora": (16, 16, ["gate_proj", "up_proj", "down_proj"], True),
}


def prompts(seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(n)] for n in (1, BLOCK, BLOCK + 3, 2 * BLOCK + 1, 41)]


def hf_greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return hf_greedy_n(model, prompt, MAX_TOKENS)


def make_adapter(
    base: torch.nn.Module, name: str, directory: Path, shape: tuple | None = None, b_std: float = 0.3
) -> torch.nn.Module:
    """A random PEFT adapter saved in ``directory`` (``shape``: rank, alpha, targets, rsLoRA; default
    ``ADAPTERS[name]``); returns the PEFT model (the oracle). PEFT's random init of B is small next to the base
    weights: B is drawn with standard deviation ``b_std`` instead, so the adapter changes the output."""
    rank, alpha, targets, rslora = shape or ADAPTERS[name]
    torch.manual_seed(sum(map(ord, name)))
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, peft.tuners.lora.LoraLayer):
                module.lora_B["default"].weight.normal_(0, b_std)
    model.save_pretrained(directory)
    return model.eval()


@pytest.fixture(scope="module")
def setup(tiny_model, tmp_path_factory):
    """The base model's path, each adapter's ``LoRARequest`` and every (adapter or None, prompt) reference."""
    path, base = tiny_model("lora-base", num_attention_heads=4, num_key_value_heads=2)
    requests, expected = {}, {None: [hf_greedy(base, p) for p in prompts()]}
    for index, name in enumerate(ADAPTERS, start=1):
        directory = tmp_path_factory.mktemp(name)
        oracle = make_adapter(base, name, directory)
        requests[name] = LoRARequest(name, index, str(directory))
        expected[name] = [hf_greedy(oracle, p) for p in prompts()]
        assert expected[name] != expected[None], f"adapter {name} does not change the output"
    return path, requests, expected


def greedy(llm: LLM, batch, adapters) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(batch, params, use_tqdm=False, lora_request=adapters)
    return [o.outputs[0].token_ids for o in outputs]


def lora_llm(path, **engine_args) -> LLM:
    args = dict(block_size=BLOCK, progress=False, dtype="float32", enable_lora=True, max_lora_rank=16)
    return LLM(str(path), **(args | engine_args))


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft(setup, name: str) -> None:
    path, requests, expected = setup
    llm = lora_llm(path, max_loras=1)
    assert greedy(llm, prompts(), requests[name]) == expected[name]


def mixed_batch(requests):
    """Every prompt under the base model and under each adapter, interleaved."""
    names = [None, *ADAPTERS]
    batch, adapters, keys = [], [], []
    for i, prompt in enumerate(prompts()):
        for j in range(len(names)):
            name = names[(i + j) % len(names)]
            batch.append(prompt)
            adapters.append(None if name is None else requests[name])
            keys.append((name, i))
    return batch, adapters, keys


def assert_mixed_batch_exact(llm: LLM, setup) -> None:
    _, requests, expected = setup
    batch, adapters, keys = mixed_batch(requests)
    got = greedy(llm, batch, adapters)
    for (name, i), tokens in zip(keys, got, strict=True):
        assert tokens == expected[name][i], f"adapter {name}, prompt {i}"
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert all(pins == 0 for pins in stats["lora"]["resident"].values())


def test_base_and_four_adapters_in_one_batch(setup) -> None:
    llm = lora_llm(setup[0], max_loras=4)
    assert_mixed_batch_exact(llm, setup)
    assert llm.stats()["lora"]["loads"] == 4  # each adapter loaded once, none evicted


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_fewer_slots_than_adapters_under_preemption_and_chunked_prefill(setup, tiny_model, preemption_mode) -> None:
    path, model = tiny_model("lora-base")
    cfg = model.config
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, 16, torch.float32)
    llm = lora_llm(
        path,
        max_loras=2,
        max_cpu_loras=2,  # host copies evicted too: reloaded from their files
        kv_cache_memory_bytes=24 * per_block,
        max_num_batched_tokens=24,
        preemption_mode=preemption_mode,
    )
    assert_mixed_batch_exact(llm, setup)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0
    lora = stats["lora"]
    # four adapters through two slots: two were evicted; their host copies too, so they were read again
    assert len(lora["resident"]) == 2 and lora["loads"] >= 4 and lora["reads"] > 4, lora


def test_prefix_cache_is_per_adapter(setup) -> None:
    """The same prompt under one adapter, then another, then the base model: no KV is shared across them."""
    path, requests, expected = setup
    llm = lora_llm(path, max_loras=1)
    prompt = prompts()[-1]  # several full blocks
    for name in ("r8-all", "r16-all", None, "r8-all"):
        adapter = None if name is None else requests[name]
        assert greedy(llm, [prompt], adapter) == [expected[name][-1]]
    # the fourth run found the first run's blocks
    assert llm.stats()["prefix_cache_hits"] >= 5 * BLOCK


def test_lora_needs_enable_lora_and_a_valid_adapter(setup, tmp_path) -> None:
    path, requests, _ = setup
    llm = LLM(str(path), block_size=BLOCK, progress=False, dtype="float32")
    with pytest.raises(InvalidRequestError, match="enable_lora"):
        llm.generate([[5, 6]], lora_request=requests["r8-all"], use_tqdm=False)
    llm = lora_llm(path, max_lora_rank=8)
    with pytest.raises(InvalidRequestError, match="max_lora_rank 8"):
        llm.generate([[5, 6]], lora_request=requests["r16-all"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="cannot read"):
        llm.generate([[5, 6]], lora_request=LoRARequest("gone", 99, str(tmp_path / "nowhere")), use_tqdm=False)
    stats = llm.stats()
    assert stats["num_requests_waiting"] == 0 and stats["lora"]["resident"] == {}
    llm.generate([[5, 6]], lora_request=requests["r8-all"], use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="already names"):
        llm.generate([[5, 6]], lora_request=LoRARequest("other", 1, str(tmp_path)), use_tqdm=False)


@pytest.mark.parametrize("process", [False, True], ids=["thread", "process"])
def test_async_engine_streams_under_adapters(setup, process: bool) -> None:
    """``AsyncLLMEngine.generate(lora_request=…)``, in this process and across the engine's child process: each
    concurrent stream equals its PEFT reference; a bad adapter ends its own stream with the engine's error."""
    import asyncio

    from pagewise import AsyncLLMEngine, EngineConfig

    path, requests, expected = setup
    config = EngineConfig(model=str(path), block_size=BLOCK, dtype="float32", enable_lora=True, max_loras=2)
    engine = AsyncLLMEngine(config, progress=False, process=process)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def one(prompt, adapter) -> list[int]:
        tokens = []
        async for output in engine.generate(prompt, params, lora_request=adapter):
            tokens += output.outputs[0].token_ids
        return tokens

    async def run() -> None:
        names = [None, "r8-all", "r16-all", "r8-attn"]
        jobs = [one(p, None if n is None else requests[n]) for n in names for p in prompts()]
        got = await asyncio.gather(*jobs)
        assert got == [expected[n][i] for n in names for i in range(len(prompts()))]
        with pytest.raises(InvalidRequestError, match="rank 32"):
            config_dir = Path(requests["r8-all"].lora_path)
            bad = config_dir.parent / "rank-too-high"
            bad.mkdir(exist_ok=True)
            (bad / "adapter_config.json").write_text('{"r": 32, "lora_alpha": 8, "target_modules": ["q_proj"]}')
            (bad / "adapter_model.safetensors").write_bytes((config_dir / "adapter_model.safetensors").read_bytes())
            await one([5, 6], LoRARequest("bad", 42, str(bad)))

    try:
        asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        engine.shutdown()


def test_adapters_in_bf16_are_close_to_peft_in_bf16(setup, tiny_model, monkeypatch) -> None:
    """``dtype=auto`` on a bf16 CPU (the capability patched in): base and adapters mixed in one batch are held to
    HF + PEFT run in bf16 by vLLM's ``check_logprobs_close`` rule (``test_bf16_accuracy``)."""
    from test_bf16_accuracy import engine_scored, first_divergence, hf_scored

    from pagewise.engine import config as engine_config

    monkeypatch.setattr(engine_config, "cpu_has_native_bf16", lambda: True)
    path, requests, _ = setup
    _, base = tiny_model("lora-base")
    names = [None, *ADAPTERS]
    expected = {}
    for name in names:
        model = copy.deepcopy(base).to(torch.bfloat16)
        if name is not None:
            model = peft.PeftModel.from_pretrained(model, requests[name].lora_path).to(torch.bfloat16)
        expected[name] = [hf_scored(model.eval(), p, MAX_TOKENS) for p in prompts()]
    llm = lora_llm(path, dtype="auto", max_loras=4)
    assert llm.stats()["precision"]["matmul"] == "bfloat16"
    batch, adapters, keys = mixed_batch(requests)
    ours = engine_scored(llm, batch, MAX_TOKENS, lora_request=adapters)
    broken = {}
    for (name, i), got in zip(keys, ours, strict=True):
        if (why := first_divergence(got, expected[name][i])) is not None:
            broken[(name, i)] = why
    assert not broken, broken


def test_generate_command_runs_prompts_under_an_adapter(setup, capsys) -> None:
    """``pagewise generate --lora DIR`` answers as the offline engine does under that adapter."""
    from pagewise.cli import main

    path, requests, _ = setup
    adapter = requests["r16-all"]
    llm = lora_llm(path)
    want = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=4), lora_request=adapter, use_tqdm=False)
    status = main(["generate", "--model", str(path), "--lora", adapter.lora_path, "--max-tokens", "4",
                   "--dtype", "float32", "--block-size", str(BLOCK), "Hello"])  # fmt: skip
    assert status == 0
    assert f"### Hello\n{want[0].outputs[0].text}\n[4 tokens" in capsys.readouterr().out
    assert main(["generate", "--model", str(path), "--lora", "/nonexistent", "Hello"]) == 2


def test_smollm2_under_random_rank_8_and_16_adapters_matches_peft(hf_smollm2, tmp_path) -> None:
    """The real default model (SmolLM2-135M from its GGUF) with two random adapters made here (rank 8 on every
    projection, rank 16 on attention and MLP parts): one batch mixing the base model and both adapters gives
    every request exactly HF transformers + PEFT's greedy tokens."""
    shapes = {"r8": (8, 16, ALL, False), "r16": (16, 32, ["q_proj", "k_proj", "o_proj", "up_proj", "down_proj"], False)}
    llm = LLM(progress=False, dtype="float32", enable_lora=True, max_lora_rank=16, max_loras=2)
    tok = llm.tokenizer
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             for q in ("What is the capital of France?", "Write a haiku about the sea.")]  # fmt: skip
    references, adapters = {None: [hf_greedy(hf_smollm2, p) for p in chats]}, {}
    for index, (name, shape) in enumerate(shapes.items(), start=1):
        model = make_adapter(hf_smollm2, name, tmp_path / name, shape, b_std=0.15)
        adapters[name] = LoRARequest(name, index, str(tmp_path / name))
        references[name] = [hf_greedy(model, p) for p in chats]
        assert references[name] != references[None], f"adapter {name} does not change the output"
        del model
    names = [None, "r8", "r16"]
    batch = [p for p in chats for _ in names]
    got = greedy(llm, batch, [adapters.get(n) for _ in chats for n in names])
    want = [references[n][i] for i in range(len(chats)) for n in names]
    assert got == want
