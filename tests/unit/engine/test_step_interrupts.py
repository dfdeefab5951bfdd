"""Step interrupts and priority classes, on a tiny random model (fp32, the exact path).

A step is paused between two layers when a request owed service arrives (``poll``): a request of a better
priority class, or under the fair policy a tenant far below the paused step's other tenants. The interrupting
step's outputs come back from that ``step`` call, the paused step's from the next; both are exactly what the
requests would have produced alone. An abort of a paused request waits for its step's end."""

from __future__ import annotations

import random

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.model_runner import KVCache

BLOCK = 8
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("interrupts", num_hidden_layers=4)


@pytest.fixture(scope="module")
def make_llm(tiny):
    cfg = tiny[1].config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
        torch.float32,
    )

    def make(**engine_args) -> LLM:
        args = dict(block_size=BLOCK, kv_cache_memory_bytes=128 * per_block, progress=False, dtype="float32")
        return LLM(str(tiny[0]), **(args | engine_args))

    return make


def _prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(length)]


FLOOD = [_prompt(i, 90) for i in range(4)]
QUIET = _prompt(99, 12)


@pytest.fixture(scope="module")
def alone(make_llm) -> dict[str, list[int]]:
    """Every prompt's greedy tokens, each run by itself."""
    llm = make_llm()
    outputs = llm.generate([*FLOOD, QUIET], GREEDY, use_tqdm=False)
    return {name: o.outputs[0].token_ids for name, o in zip(["f0", "f1", "f2", "f3", "quiet"], outputs, strict=True)}


def _run(engine, poll=None) -> dict[str, list[int]]:
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o.outputs[0].token_ids for o in engine.step(poll) if o.finished})
    return finals


def _flood(engine, priority: int = 0) -> None:
    for i, prompt in enumerate(FLOOD):
        engine.add_request(f"f{i}", prompt, GREEDY, tenant_id="flood", priority=priority)


def _arrive_once(engine, request_id: str, tenant: str, priority: int = 0):
    """A poll that adds the quiet request the first time the engine polls."""
    arrived = []

    def poll() -> None:
        if not arrived:
            arrived.append(request_id)
            engine.add_request(request_id, QUIET, GREEDY, tenant_id=tenant, priority=priority)

    return poll


def test_a_light_tenant_interrupts_a_heavy_step_under_fair(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fair")
    engine = llm.engine
    _flood(engine)
    poll = _arrive_once(engine, "quiet", "quiet")
    first = engine.step(poll)  # the flood's step pauses after layer 0's attention; the quiet prefill runs whole
    assert [o.request_id for o in first] == ["quiet"] and first[0].outputs[0].token_ids == alone["quiet"][:1]
    paused = engine._in_flight.run.forward
    assert (paused.next_layer, paused.mlp_rows_done) == (0, 0)
    stats = llm.stats()
    assert (stats["steps_paused"], stats["step_interrupts"]) == (1, 1) and stats["step_time_paused_seconds"] > 0
    assert _run(engine, poll) == alone
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_a_tenants_own_arrivals_never_interrupt_its_step(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fair")
    engine = llm.engine
    _flood(engine)
    poll = _arrive_once(engine, "quiet", "flood")
    first = engine.step(poll)
    assert first == [] or all(o.request_id != "quiet" for o in first)
    assert engine._in_flight is None and llm.stats()["step_interrupts"] == 0
    assert _run(engine, poll) == alone


def test_a_better_class_interrupts_and_the_same_class_does_not(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fcfs")
    engine = llm.engine
    _flood(engine, priority=1)
    first = engine.step(_arrive_once(engine, "quiet", "other", priority=0))
    assert [o.request_id for o in first] == ["quiet"]
    assert _run(engine) == alone

    llm = make_llm(scheduling_policy="fcfs")
    engine = llm.engine
    _flood(engine, priority=1)
    first = engine.step(_arrive_once(engine, "quiet", "other", priority=1))
    assert all(o.request_id != "quiet" for o in first) and llm.stats()["step_interrupts"] == 0
    assert _run(engine) == alone


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_better_class_arriving_between_steps_skips_the_worse_class_decodes_once(make_llm, alone, policy) -> None:
    """Between two steps no step can be paused: the next one is short for the arrival, and a worse class's running
    decodes wait for the step after it (as they would behind an interrupting step); outputs stay exact."""
    llm = make_llm(scheduling_policy=policy)
    engine = llm.engine
    _flood(engine, priority=1)
    flood = list(engine.scheduler.waiting)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in flood):
        engine.step()
    engine.add_request("quiet", QUIET, GREEDY, tenant_id="other", priority=0)
    lengths = [len(r.token_ids) for r in flood]
    outputs = engine.step()
    assert [o.request_id for o in outputs] == ["quiet"] and len(outputs[0].outputs[0].token_ids) == 1
    assert [len(r.token_ids) for r in flood] == lengths
    assert _run(engine) == alone


def test_interrupts_can_be_turned_off_and_are_capped_per_step(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fcfs", enable_step_interrupts=False)
    engine = llm.engine
    _flood(engine, priority=1)
    engine.step(_arrive_once(engine, "quiet", "other"))
    assert llm.stats()["step_interrupts"] == 0 and engine._in_flight is None

    llm = make_llm(scheduling_policy="fcfs", max_interrupts_per_step=0)
    engine = llm.engine
    _flood(engine, priority=1)
    poll = _arrive_once(engine, "quiet", "other")
    engine.step(poll)  # no interrupt allowed: the step runs whole without looking for arrivals
    assert llm.stats()["step_interrupts"] == 0 and engine._in_flight is None
    poll()  # what the step loop does between steps
    assert _run(engine) == alone


def test_an_abort_of_a_paused_request_waits_for_its_step(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fcfs")
    engine = llm.engine
    _flood(engine, priority=1)
    engine.step(_arrive_once(engine, "quiet", "other"))
    assert engine._in_flight is not None
    assert engine.abort_request("f0") is None  # f0 is in the paused step: its KV is still being written
    assert not engine.scheduler.running[0].finished
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outputs["f0"].outputs[0].finish_reason == "abort"
    assert {k: o.outputs[0].token_ids for k, o in outputs.items() if k != "f0"} == {
        k: v for k, v in alone.items() if k != "f0"
    }
    assert llm.stats()["kv_blocks_free"] == llm.stats()["kv_blocks_total"]


def test_priority_orders_admission_and_preemption(make_llm) -> None:
    llm = make_llm(scheduling_policy="fcfs", max_num_seqs=1)
    engine = llm.engine
    engine.add_request("later", QUIET, GREEDY, priority=5)
    engine.add_request("sooner", QUIET, GREEDY, priority=-1)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["sooner"]
    _run(engine)


def test_offline_priority_and_bad_priorities(make_llm, alone) -> None:
    llm = make_llm(scheduling_policy="fair")
    outputs = llm.generate([*FLOOD, QUIET], GREEDY, use_tqdm=False, priority=[1, 1, 1, 1, 0])
    assert [o.outputs[0].token_ids for o in outputs] == list(alone.values())
    with pytest.raises(InvalidRequestError, match="priority has 1 entries for 2 prompts"):
        llm.generate([QUIET, QUIET], GREEDY, use_tqdm=False, priority=[0])
    for bad in (1.5, "high", 10**7, True):
        with pytest.raises(InvalidRequestError, match="priority must be an integer"):
            llm.generate([QUIET], GREEDY, use_tqdm=False, priority=[bad])
    assert not llm.engine.has_unfinished_requests()


def test_a_long_step_runs_its_mlp_in_parts_and_is_exact(make_llm) -> None:
    """800 prompt tokens in one step: each layer's MLP runs in two parts (``MLP_ROWS_PER_PART`` = 512), paused
    at every part for the requests outside the step (the test switch); every output equals its own run alone."""
    from pagewise.engine.models.llama import MLP_ROWS_PER_PART

    prompts = [_prompt(200 + i, 100) for i in range(8)]
    assert sum(map(len, prompts)) > MLP_ROWS_PER_PART
    single = make_llm()
    alone = [single.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    llm = make_llm(force_step_interrupts=True, max_num_batched_tokens=800)
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, GREEDY)
    engine.add_request("late", QUIET, GREEDY)  # no budget left for it in the first step: it interrupts it
    finals = _run(engine)
    assert [finals[f"p{i}"] for i in range(8)] == alone
    assert llm.stats()["step_interrupts"] > 0
