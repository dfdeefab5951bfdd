"""Billing: every output carries the request's cumulative ``RequestUsage``, and ``AsyncLLMEngine`` resolves a
``usage`` future exactly once with the final one however the request leaves — finished, abandoned mid-stream,
abandoned before the engine saw it, aborted mid-prefill. Prompt tokens are a high-water mark (a recompute is not
charged twice); completion tokens count every generated token, received or not."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import Future

import pytest
import torch

from pagewise import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.model_runner import KVCache
from pagewise.engine.outputs import RequestUsage

BLOCK = 4
VOCAB = 49152
CHUNK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
TIMEOUT = 60


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("usage-llama")


@pytest.fixture(scope="module")
def config(tiny) -> EngineConfig:
    cfg = tiny[1].config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, torch.float32
    )
    return EngineConfig(
        model=str(tiny[0]),
        block_size=BLOCK,
        kv_cache_memory_bytes=128 * per_block,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        dtype="float32",
    )


def make_llm(config: EngineConfig, **overrides) -> LLM:
    fields = {name: getattr(config, name) for name in config.__dataclass_fields__ if name != "model"}
    return LLM(config.model, progress=False, **(fields | overrides))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


# ---- LLMEngine: usage on every output


def test_usage_of_finished_requests(config) -> None:
    llm = make_llm(config)
    prompt = _prompt(21, 1)
    (one,) = llm.generate([prompt], GREEDY, use_tqdm=False)
    assert one.usage == RequestUsage(prompt_tokens=21, cached_tokens=0, completion_tokens=5)
    (three,) = llm.generate(
        [prompt], SamplingParams(n=3, temperature=1.0, seed=2, max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert three.usage == RequestUsage(
        prompt_tokens=21, cached_tokens=20, completion_tokens=15
    )  # the prompt once, its 5 full blocks from the cache; 3 samples
    assert three.num_cached_tokens == 20


def test_usage_is_cumulative_on_every_delta(config) -> None:
    engine = make_llm(config).engine
    engine.add_request("d", _prompt(19, 2), GREEDY, delta=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.usage for o in engine.step()]
    assert [u.completion_tokens for u in seen] == [1, 2, 3, 4, 5]
    assert all(u.prompt_tokens == 19 and u.cached_tokens == 0 for u in seen)


def test_an_aborted_chunked_prefill_is_charged_for_the_chunks_run(config) -> None:
    llm = make_llm(config)
    engine = llm.engine
    shared = _prompt(12, 3)
    llm.generate([shared + [7]], GREEDY, use_tqdm=False)  # leaves 3 full blocks (12 tokens) in the cache
    for name, prompt, want in [
        ("cold", _prompt(30, 4), RequestUsage(prompt_tokens=2 * CHUNK, cached_tokens=0, completion_tokens=0)),
        (
            "warm",
            shared + _prompt(18, 5),
            RequestUsage(prompt_tokens=12 + 2 * CHUNK, cached_tokens=12, completion_tokens=0),
        ),
    ]:
        engine.add_request(name, prompt, GREEDY)
        assert engine.step() == [] and engine.step() == []  # two chunks, no token yet
        assert engine.abort_request(name).usage == want


@pytest.mark.parametrize("budget", [None, CHUNK], ids=["whole-prompts", "chunked"])
def test_a_recompute_is_not_charged_twice(config, tiny, budget) -> None:
    cfg = tiny[1].config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads, torch.float32
    )
    llm = make_llm(config, kv_cache_memory_bytes=14 * per_block, max_num_batched_tokens=budget)
    prompts = [_prompt(n, 10 + n) for n in (30, 9, 17, 25, 3)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0
    assert [o.usage for o in outs] == [
        RequestUsage(prompt_tokens=len(p), cached_tokens=0, completion_tokens=10) for p in prompts
    ]


# ---- AsyncLLMEngine: the usage future


@pytest.fixture(scope="module")
def engine(config):
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


async def settled(future: Future) -> RequestUsage:
    return await asyncio.wait_for(asyncio.wrap_future(future), 10)


async def wait_idle(engine: AsyncLLMEngine) -> dict:
    for _ in range(500):
        stats = engine.stats()
        if stats["num_requests_running"] == stats["num_requests_waiting"] == 0:
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError("engine never went idle")


def test_usage_future_of_a_finished_request(engine) -> None:
    async def main():
        usage = Future()
        outs = [o async for o in engine.generate(_prompt(10, 20), GREEDY, usage=usage)]
        return outs, await settled(usage)

    outs, usage = run(main())
    assert usage == outs[-1].usage == RequestUsage(prompt_tokens=10, cached_tokens=0, completion_tokens=5)


def test_usage_future_when_the_consumer_leaves_after_k_tokens(engine) -> None:
    async def main():
        before = (await wait_idle(engine))["generation_tokens_total"]
        usage, received = Future(), 0
        async for out in engine.generate(_prompt(6, 21), LONG, usage=usage):
            received += len(out.outputs[0].token_ids)
            if received >= 3:
                break
        final = await settled(usage)
        await asyncio.sleep(0.05)
        after = (await wait_idle(engine))["generation_tokens_total"]
        return received, final, after - before

    received, final, generated = run(main())
    assert final.prompt_tokens == 6 and final.cached_tokens == 0
    assert received <= final.completion_tokens < LONG.max_tokens
    assert final.completion_tokens == generated  # including tokens made after the consumer left


def test_usage_future_when_the_consumer_leaves_before_the_engine_saw_it(engine, monkeypatch) -> None:
    """The engine thread is held inside a step while a consumer arrives and leaves: its add is skipped and its
    usage is all zeros; nothing of it ever runs."""
    inner = engine.engine.step
    entered, gate = threading.Event(), threading.Event()

    def held_step(poll=None):
        entered.set()
        gate.wait(10)
        return inner(poll)

    async def main():
        blocker = engine.generate(_prompt(5, 22), LONG)
        await anext(blocker)
        monkeypatch.setattr(engine.engine, "step", held_step)
        await asyncio.to_thread(entered.wait, 10)
        before = engine.engine.prompt_tokens_total
        usage = Future()
        ghost = engine.generate(_prompt(9, 23), GREEDY, usage=usage)
        waiting = asyncio.ensure_future(anext(ghost))
        await asyncio.sleep(0.01)  # the add is posted; the engine thread is still held
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await ghost.aclose()
        monkeypatch.setattr(engine.engine, "step", inner)
        gate.set()
        result = await settled(usage)
        await blocker.aclose()
        await wait_idle(engine)
        return result, engine.engine.prompt_tokens_total - before

    usage, added_prompt_tokens = run(main())
    assert usage == RequestUsage(prompt_tokens=0, cached_tokens=0, completion_tokens=0)
    assert added_prompt_tokens == 0


def test_usage_future_of_a_chunked_prefill_aborted_midway(engine, monkeypatch) -> None:
    inner = engine.engine.step
    steps = []

    def counting_step(poll=None):
        outputs = inner(poll)
        steps.append(len(outputs))
        if len(steps) == 2:
            engine.abort("chunky")  # processed before the third chunk
        return outputs

    async def main():
        await wait_idle(engine)
        monkeypatch.setattr(engine.engine, "step", counting_step)
        usage = Future()
        outs = [o async for o in engine.generate(_prompt(30, 24), GREEDY, request_id="chunky", usage=usage)]
        return outs, await settled(usage)

    outs, usage = run(main())
    assert usage == RequestUsage(prompt_tokens=2 * CHUNK, cached_tokens=0, completion_tokens=0)
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert outs[0].usage == usage


@pytest.mark.parametrize("prompt", [[], [VOCAB]], ids=["empty", "oov"])
def test_usage_future_of_a_rejected_request(engine, prompt) -> None:
    async def main():
        usage = Future()
        with pytest.raises(InvalidRequestError):
            async for _ in engine.generate(prompt, GREEDY, usage=usage):
                pass
        return await settled(usage)

    assert run(main()) == RequestUsage(prompt_tokens=0, cached_tokens=0, completion_tokens=0)
