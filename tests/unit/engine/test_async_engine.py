"""``AsyncLLMEngine`` on a tiny model: concurrent streams equal the offline engine's outputs, deltas are
well-formed, leaving a stream early or aborting it frees everything, bad input raises on the caller."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pagewise import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from pagewise.engine.errors import InvalidRequestError, PromptTooLongError

BLOCK = 4
NUM_BLOCKS = 100  # 400 token slots: less than max_model_len (512)
MAX_NUM_SEQS = 8
MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
TIMEOUT = 60


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


PROMPTS = [_prompt(1, 1), _prompt(5, 2), _prompt(8, 3), _prompt(13, 4)]


@pytest.fixture(scope="module")
def config(paged_config) -> EngineConfig:
    return paged_config("async-llama", BLOCK, NUM_BLOCKS, max_num_seqs=MAX_NUM_SEQS)


@pytest.fixture(scope="module", params=["thread", "process"])
def engine(config, request):
    """Every test here runs against the engine stepped in a thread of this process and in a child process."""
    engine = AsyncLLMEngine(config, progress=False, process=request.param == "process")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(config):
    """The offline engine's greedy outputs for ``PROMPTS`` (and the string prompt): the reference."""
    llm = LLM.from_config(config, progress=False)
    outs = llm.generate(PROMPTS + ["hello there"], GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].text) for o in outs]


async def collect(engine: AsyncLLMEngine, prompt, params=GREEDY, request_id=None, tenant_id=None) -> list:
    return [out async for out in engine.generate(prompt, params, request_id=request_id, tenant_id=tenant_id)]


async def wait_for_stats(engine: AsyncLLMEngine, predicate, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.02)


def idle(stats: dict) -> bool:
    return (stats["num_requests_running"] == stats["num_requests_waiting"] == 0
            and stats["kv_blocks_free"] == stats["kv_blocks_total"])


def idle_after(before: dict):
    """Idle, and the snapshot is from after at least one token more than ``before`` (stats lag a step)."""
    return lambda s: idle(s) and s["generation_tokens_total"] > before["generation_tokens_total"]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


def test_concurrent_streams_equal_offline_outputs(engine, expected) -> None:
    prompts = PROMPTS + ["hello there"]

    async def main():
        return await asyncio.gather(*(collect(engine, p, request_id=f"c{i}") for i, p in enumerate(prompts)))

    results = run(main())
    for i, (prompt, deltas, (want_tokens, want_text)) in enumerate(zip(prompts, results, expected, strict=True)):
        assert all(d.request_id == f"c{i}" for d in deltas)
        assert all(len(d.outputs) == 1 and d.outputs[0].index == 0 for d in deltas)
        assert [len(d.outputs[0].token_ids) for d in deltas] == [1] * MAX_TOKENS  # one new token per step
        assert [t for d in deltas for t in d.outputs[0].token_ids] == want_tokens
        assert "".join(d.outputs[0].text for d in deltas) == want_text
        assert [d.finished for d in deltas] == [False] * (MAX_TOKENS - 1) + [True]
        assert [d.outputs[0].finish_reason for d in deltas] == [None] * (MAX_TOKENS - 1) + ["length"]
        if isinstance(prompt, list):
            assert all(d.prompt_token_ids == prompt for d in deltas)
        else:
            assert deltas[-1].prompt == prompt
    stats = run(wait_for_stats(engine, idle))
    assert idle(stats)


def test_parallel_samples_stream_per_index_with_stop_string_and_logprobs(engine, config, expected) -> None:
    text = expected[3][1]
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    params = SamplingParams(n=2, temperature=0.9, seed=8, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop],
                            logprobs=1)
    llm = LLM.from_config(config, progress=False)
    (want,) = llm.generate([PROMPTS[3]], params, use_tqdm=False)
    want_greedy_stop = llm.generate([PROMPTS[3]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop]),
                                    use_tqdm=False)[0].outputs[0]
    assert want_greedy_stop.finish_reason == "stop" and want_greedy_stop.text == text[: text.find(stop)]

    deltas = run(collect(engine, PROMPTS[3], params))
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])
    for index, completion in enumerate(want.outputs):
        parts = [c for d in deltas for c in d.outputs if c.index == index]
        assert [t for c in parts for t in c.token_ids] == completion.token_ids
        assert "".join(c.text for c in parts) == completion.text
        got = [lp for c in parts for lp in c.logprobs]
        assert [[(t, e.rank) for t, e in d.items()] for d in got] == [
            [(t, e.rank) for t, e in d.items()] for d in completion.logprobs
        ]
        flat = [e.logprob for d in got for e in d.values()]
        assert flat == pytest.approx([e.logprob for d in completion.logprobs for e in d.values()], abs=1e-5)
        assert [c.finish_reason for c in parts][-1] == completion.finish_reason
        assert all(c.finish_reason is None for c in parts[:-1])
    greedy = run(collect(engine, PROMPTS[3], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop=[stop])))
    assert "".join(d.outputs[0].text for d in greedy) == want_greedy_stop.text
    assert greedy[-1].outputs[0].finish_reason == "stop" and greedy[-1].outputs[0].stop_reason == stop


def test_breaking_out_of_the_stream_aborts(engine) -> None:
    async def main():
        before = await wait_for_stats(engine, idle)
        async for out in engine.generate(PROMPTS[2], LONG, request_id="leaver"):
            assert not out.finished
            break
        after = await wait_for_stats(engine, idle_after(before))
        return before, after

    before, after = run(main())
    assert idle(after), after
    generated = after["generation_tokens_total"] - before["generation_tokens_total"]
    assert 1 <= generated < LONG.max_tokens


def test_explicit_aclose_aborts(engine) -> None:
    async def main():
        before = await wait_for_stats(engine, idle)
        stream = engine.generate(PROMPTS[1], LONG, request_id="closer")
        first = await anext(stream)
        await stream.aclose()
        after = await wait_for_stats(engine, idle_after(before))
        return first, before, after

    first, before, after = run(main())
    assert first.outputs[0].token_ids and not first.finished
    assert idle(after), after
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < LONG.max_tokens


def test_abort_from_another_task_ends_the_stream(engine) -> None:
    async def main():
        before = await wait_for_stats(engine, idle)
        first = asyncio.Event()
        seen = []

        async def consumer():
            async for out in engine.generate(PROMPTS[3], LONG, request_id="victim"):
                seen.append(out)
                first.set()

        task = asyncio.create_task(consumer())
        await first.wait()
        engine.abort("victim")
        try:
            await asyncio.wait_for(task, 5)
            ended = True
        except TimeoutError:
            ended = False
        after = await wait_for_stats(engine, idle_after(before))
        return ended, seen, before, after

    ended, seen, before, after = run(main())
    assert idle(after), after
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < LONG.max_tokens
    assert ended, "the aborted request's generate() never finished: its consumer waits forever"
    tokens = sum(len(d.outputs[0].token_ids) for d in seen if d.outputs)
    assert tokens < LONG.max_tokens
    if seen[-1].finished:
        assert seen[-1].outputs[0].finish_reason == "abort"


def test_abort_of_unknown_id_is_harmless(engine, expected) -> None:
    engine.abort("never-existed")
    deltas = run(collect(engine, PROMPTS[0]))
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected[0][0]


@pytest.mark.parametrize(
    ("prompt", "params", "error", "match"),
    [
        ([], GREEDY, InvalidRequestError, "prompt is empty"),
        ("", GREEDY, InvalidRequestError, "prompt is empty"),
        ([1, 49152], GREEDY, InvalidRequestError, "prompt token ids"),
        (_prompt(512, 9), GREEDY, PromptTooLongError, "max_model_len is 512"),
        (PROMPTS[1], SamplingParams(n=MAX_NUM_SEQS + 1), InvalidRequestError, "exceeds max_num_seqs"),
        (PROMPTS[1], SamplingParams(max_tokens=NUM_BLOCKS * BLOCK), InvalidRequestError, "whole cache holds"),
    ],
    ids=["empty-list", "empty-str", "oov", "too-long", "n", "kv"],
)
def test_bad_input_raises_on_the_caller(engine, expected, prompt, params, error, match) -> None:
    async def main():
        before = await wait_for_stats(engine, idle)
        with pytest.raises(error, match=match):
            await collect(engine, prompt, params)
        await asyncio.sleep(0.05)
        after_bad = await wait_for_stats(engine, idle)
        good = await collect(engine, PROMPTS[1])
        return before, after_bad, good

    before, after_bad, good = run(main())
    assert after_bad == before
    assert [t for d in good for t in d.outputs[0].token_ids] == expected[1][0]


def test_duplicate_live_request_id_raises_and_keeps_the_first(engine, expected) -> None:
    async def main():
        stream = engine.generate(PROMPTS[1], GREEDY, request_id="twin")
        first = await anext(stream)
        with pytest.raises(InvalidRequestError, match="request id 'twin' is already in use"):
            await collect(engine, PROMPTS[2], request_id="twin")
        rest = [out async for out in stream]
        return [first, *rest]

    deltas = run(main())
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected[1][0]
    assert deltas[-1].finished


def test_reusing_an_id_right_after_leaving_gets_a_request_of_its_own(engine, expected) -> None:
    """The old call's late abort and final output must not reach the new call that reuses its id (the platform
    closes a disconnected client's stream, then a retry comes with the same id)."""
    async def main():
        old = engine.generate(PROMPTS[2], LONG, request_id="again")
        await anext(old)
        await old.aclose()
        deltas = await collect(engine, PROMPTS[1], request_id="again")
        stats = await wait_for_stats(engine, idle)
        return deltas, stats

    deltas, stats = run(main())
    assert [t for d in deltas for t in d.outputs[0].token_ids] == expected[1][0]
    assert all(d.request_id == "again" for d in deltas)
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"
    assert idle(stats), stats


def test_abort_releases_the_id_at_once(engine, expected) -> None:
    async def main():
        old = engine.generate(PROMPTS[3], LONG, request_id="released")
        first = await anext(old)
        engine.abort("released")
        new = await collect(engine, PROMPTS[1], request_id="released")  # not "already in use"
        rest = [out async for out in old]
        return first, new, rest

    first, new, rest = run(main())
    assert not first.finished
    assert [t for d in new for t in d.outputs[0].token_ids] == expected[1][0]
    assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert all(d.request_id == "released" for d in [first, *new, *rest])


def test_stats_count_prompt_and_generation_tokens(engine) -> None:
    params = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=3, max_tokens=7, ignore_eos=True)]

    async def main():
        before = await wait_for_stats(engine, idle)
        await asyncio.gather(collect(engine, PROMPTS[2], params[0]), collect(engine, PROMPTS[3], params[1]))
        want_gen = before["generation_tokens_total"] + 11
        after = await wait_for_stats(engine, lambda s: s["generation_tokens_total"] >= want_gen and idle(s))
        return before, after

    before, after = run(main())
    assert after["prompt_tokens_total"] - before["prompt_tokens_total"] == len(PROMPTS[2]) + len(PROMPTS[3])
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == 11
    assert idle(after)
    for key in ("num_requests_running", "num_requests_waiting", "kv_blocks_total", "kv_blocks_free",
                "kv_cache_usage_perc", "num_preemptions", "prefix_cache_queries", "prefix_cache_hits"):
        assert key in after
    assert after["kv_cache_usage_perc"] == 0.0


def test_stats_reflect_a_finished_stream_immediately(engine, monkeypatch) -> None:
    """Once a caller has the final delta, ``stats()`` already includes that step (no lagging snapshot). The lag
    is a race between the engine thread and the event loop; a slow ``LLMEngine.stats`` widens the window so the
    outcome does not depend on scheduling luck. (A child process's stats arrive with the outputs of the same
    step, ahead of them: nothing to slow down there.)"""
    if engine.engine is None:
        pytest.skip("the engine runs in a child process")
    inner = engine.engine.stats

    def slow_stats():
        time.sleep(0.05)
        return inner()

    monkeypatch.setattr(engine.engine, "stats", slow_stats)

    async def main():
        seen = []
        for _ in range(3):
            before = await wait_for_stats(engine, idle)
            await collect(engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
            after = engine.stats()
            seen.append((after["generation_tokens_total"] - before["generation_tokens_total"], idle(after)))
        return seen

    assert run(main()) == [(2, True)] * 3
