"""``LLMEngine`` contains failures: a failed step fails exactly the requests it touched (scheduled, swapped out or
swapped in by it), frees their blocks and swap slots to the last one, and the engine serves the rest exactly as
before; ``reset_prefix_cache`` refuses while blocks are in use."""

from __future__ import annotations

import random

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine.errors import RequestFailedError, StepFailedError
from pagewise.engine.model_runner import KVCache

BLOCK = 4
VOCAB = 49152
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


A, B, C = _prompt(9, 1), _prompt(5, 2), _prompt(7, 3)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("failures-llama")


@pytest.fixture(scope="module")
def make_llm(tiny):
    cfg = tiny[1].config
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads,
                                        cfg.hidden_size // cfg.num_attention_heads, torch.float32)

    def make(blocks: int = 64, swap_blocks: int = 0, **engine_args) -> LLM:
        return LLM(str(tiny[0]), block_size=BLOCK, kv_cache_memory_bytes=blocks * per_block,
                   swap_space_bytes=swap_blocks * per_block, progress=False, **({"dtype": "float32"} | engine_args))

    return make


@pytest.fixture(scope="module")
def expected(make_llm) -> dict[str, list[int]]:
    llm = make_llm()
    return {name: o.outputs[0].token_ids
            for name, o in zip("ABC", llm.generate([A, B, C], GREEDY, use_tqdm=False), strict=True)}


def run_all(engine) -> dict[str, list[int]]:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished})
    return finals


def assert_accounted(engine) -> None:
    """Every block and swap slot is held by a live request or free; nothing leaked."""
    engine.kv.check_accounting(engine._live_requests())
    in_use = sum(1 for b in engine.pool.blocks if b.ref_count > 0)
    assert engine.pool.num_free + in_use == engine.num_blocks


@pytest.mark.parametrize(("target", "what"), [("runner.start", "the forward pass"),
                                               ("scheduler.schedule", "scheduling")])
def test_a_failed_step_fails_only_its_requests(make_llm, expected, monkeypatch, target, what) -> None:
    llm = make_llm(max_num_seqs=2)
    engine = llm.engine
    for name, prompt in zip("ABC", (A, B, C), strict=True):
        engine.add_request(name, prompt, GREEDY)
    engine.step()  # A and B prefill; C waits for a free sequence slot
    owner_name, attr = target.split(".")
    owner = getattr(engine, owner_name)
    real = getattr(owner, attr)

    def broken(*args):
        raise RuntimeError("device lost")

    monkeypatch.setattr(owner, attr, broken)
    with pytest.raises(StepFailedError, match=what) as info:
        engine.step()
    monkeypatch.setattr(owner, attr, real)
    failed = {o.request_id: o for o in info.value.outputs}
    assert set(failed) == {"A", "B"}
    for output in failed.values():
        assert output.finished and output.outputs[0].finish_reason == "error"
        assert isinstance(output.error, RequestFailedError) and what in str(output.error)
        assert str(output.error.__cause__) == "device lost"
    assert_accounted(engine)
    assert engine.pool.num_free == engine.num_blocks  # C held nothing yet
    assert run_all(engine) == {"C": expected["C"]}
    assert_accounted(engine)
    assert run_all(engine) == {}
    assert llm.generate([A], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == expected["A"]


def test_a_failed_step_fails_the_requests_it_swapped_out(make_llm, monkeypatch) -> None:
    """A victim swapped out in the failed step lost its saved KV (the copy may never have run): it fails too,
    and its swap slots come back."""
    llm = make_llm(blocks=12, swap_blocks=64, preemption_mode="swap")
    engine = llm.engine
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(4):
        engine.add_request(f"r{i}", _prompt(8, 10 + i), long)
    real = engine.runner.start
    seen = {}

    def fail_on_swap_out(step):
        if any(op.kind == "swap_out" for op in step.block_ops):
            seen["victims"] = [r.group_id for r in step.preempted]
            raise RuntimeError("device lost")
        return real(step)

    monkeypatch.setattr(engine.runner, "start", fail_on_swap_out)
    with pytest.raises(StepFailedError) as info:
        while engine.has_unfinished_requests():
            engine.step()
    failed = {o.request_id for o in info.value.outputs}
    assert seen["victims"] and set(seen["victims"]) <= failed
    assert not engine.scheduler.swapped
    assert len(engine.kv.swap.free_slots) == engine.kv.swap.num_slots
    assert_accounted(engine)
    monkeypatch.setattr(engine.runner, "start", real)
    survivors = run_all(engine)
    assert set(survivors) == {f"r{i}" for i in range(4)} - failed
    assert all(len(t) == 30 for t in survivors.values())
    assert engine.pool.num_free == engine.num_blocks


def test_reset_prefix_cache_refuses_while_blocks_are_in_use(make_llm, expected) -> None:
    llm = make_llm()
    engine = llm.engine
    llm.generate([A], GREEDY, use_tqdm=False)
    cached = dict(engine.pool.cached)
    assert cached
    engine.add_request("live", B, GREEDY)
    engine.step()
    held = [b for b in engine.pool.blocks if b.ref_count > 0]
    assert not llm.reset_prefix_cache()
    assert engine.pool.cached == cached | {b.block_hash: b for b in held if b.block_hash is not None}
    assert run_all(engine) == {"live": expected["B"]}
    assert llm.reset_prefix_cache()
    assert engine.pool.cached == {} and all(b.block_hash is None for b in engine.pool.blocks)
