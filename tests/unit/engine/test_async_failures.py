"""No single request stops ``AsyncLLMEngine`` for everyone: a request failing in its share of a step, in
``add_request`` or in a failed step gets a ``RequestFailedError`` while the others are served exactly; only
repeated failed steps or an error outside a step kill the engine — and then every waiting consumer hears it,
``is_alive()`` is False, ``on_dead`` runs once, and nothing restarts it or tokenizes for it."""

from __future__ import annotations

import asyncio
import random
import threading
from concurrent.futures import Future

import pytest

from pagewise import LLM, AsyncLLMEngine, EngineConfig, SamplingParams
from pagewise.engine.errors import EngineDeadError, RequestFailedError, StepFailedError
from pagewise.engine.request_group import SampleState

BLOCK = 4
VOCAB = 49152
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
TIMEOUT = 60


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


PROMPTS = [_prompt(5, 1), _prompt(8, 2), _prompt(13, 3)]
VICTIM = _prompt(7, 99)


@pytest.fixture(scope="module")
def config(paged_config) -> EngineConfig:
    return paged_config("async-failures-llama", BLOCK, 200, max_num_seqs=8)


@pytest.fixture(scope="module")
def expected(config) -> list[list[int]]:
    llm = LLM.from_config(config, progress=False)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def engine(config):
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def collect(engine: AsyncLLMEngine, prompt, params=GREEDY, **kwargs) -> list[int]:
    return [t async for out in engine.generate(prompt, params, **kwargs) for t in out.outputs[0].token_ids]


async def failure_of(engine: AsyncLLMEngine, prompt, params=GREEDY, **kwargs) -> BaseException:
    try:
        await collect(engine, prompt, params, **kwargs)
    except BaseException as error:  # noqa: BLE001 - the error is what the test inspects
        return error
    raise AssertionError("the request did not fail")


async def idle(engine: AsyncLLMEngine) -> dict:
    for _ in range(500):
        stats = engine.stats()
        if (stats["num_requests_running"] == stats["num_requests_waiting"] == 0
                and stats["kv_blocks_free"] == stats["kv_blocks_total"]):
            return stats
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine never went idle: {engine.stats()}")


@pytest.mark.parametrize(
    ("where", "what", "params"),
    [
        ("detokenize", "processing its new token", GREEDY),
        ("sample", "sampling its next token", SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)),
    ],
)
def test_a_request_failing_inside_a_step_fails_alone(engine, expected, monkeypatch, where, what, params) -> None:
    if where == "detokenize":
        inner = SampleState.after_token

        def flaky(self, token, *args):
            if self.request.prompt_token_ids == VICTIM and self.request.num_output_tokens == 2:
                raise ValueError("bad bytes")
            return inner(self, token, *args)

        monkeypatch.setattr(SampleState, "after_token", flaky)
    else:
        sampler = engine.engine.runner.sampler
        inner = sampler._draw

        def flaky(logits, request):
            if request.prompt_token_ids == VICTIM:
                raise ValueError("bad row")
            return inner(logits, request)

        monkeypatch.setattr(sampler, "_draw", flaky)

    async def main():
        usage = Future()
        results = await asyncio.gather(failure_of(engine, VICTIM, params, usage=usage),
                                       *(collect(engine, p) for p in PROMPTS))
        await idle(engine)
        return results, await asyncio.wrap_future(usage)

    (error, *others), usage = run(main())
    assert isinstance(error, RequestFailedError) and what in str(error)
    assert isinstance(error.__cause__, ValueError)
    assert others == expected
    assert usage.prompt_tokens == len(VICTIM)
    assert engine.is_alive()
    assert run(collect(engine, PROMPTS[0])) == expected[0]


def test_an_unexpected_error_in_add_fails_only_that_request(engine, expected, monkeypatch) -> None:
    inner = engine.engine.add_request

    def flaky(request_id, prompt, *args, **kwargs):
        if list(prompt) == VICTIM:
            raise KeyError("tokenizer state")
        return inner(request_id, prompt, *args, **kwargs)

    monkeypatch.setattr(engine.engine, "add_request", flaky)

    async def main():
        usage = Future()
        results = await asyncio.gather(failure_of(engine, VICTIM, usage=usage), collect(engine, PROMPTS[1]))
        return results, await asyncio.wrap_future(usage)

    (error, tokens), usage = run(main())
    assert isinstance(error, RequestFailedError) and "could not be added" in str(error)
    assert isinstance(error.__cause__, KeyError)
    assert tokens == expected[1] and usage.completion_tokens == 0
    assert engine.is_alive()


def test_a_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine, expected, monkeypatch) -> None:
    runner = engine.engine.runner
    inner = runner.start
    armed = threading.Event()

    def flaky(step):
        if armed.is_set():
            armed.clear()
            raise RuntimeError("device lost")
        return inner(step)

    monkeypatch.setattr(runner, "start", flaky)

    async def main():
        usages = [Future(), Future()]
        streams = [engine.generate(p, LONG, usage=u) for p, u in zip(PROMPTS[:2], usages, strict=True)]
        firsts = await asyncio.gather(*(anext(s) for s in streams))
        armed.set()
        errors = []
        for stream in streams:
            try:
                async for _ in stream:
                    pass
            except RequestFailedError as error:
                errors.append(error)
        stats = await idle(engine)
        return firsts, errors, [await asyncio.wrap_future(u) for u in usages], stats

    firsts, errors, usages, stats = run(main())
    assert len(errors) == 2 and all("the forward pass" in str(e) for e in errors)
    assert all(u.completion_tokens >= len(f.outputs[0].token_ids) for u, f in zip(usages, firsts, strict=True))
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    engine.engine.kv.check_accounting([])  # exact: nothing held, nothing leaked, swap slots all free
    assert engine.is_alive()
    assert run(collect(engine, PROMPTS[2])) == expected[2]


def test_repeated_step_failures_kill_the_engine(config, monkeypatch) -> None:
    dead: list[BaseException] = []
    engine = AsyncLLMEngine(config, progress=False, on_dead=dead.append)

    def broken(step):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.engine.runner, "start", broken)

    async def main():
        failures = [await failure_of(engine, p) for p in PROMPTS]  # each one step; the third is the last
        await asyncio.to_thread(engine._threads[0].join, 10)
        return failures

    failures = run(main())
    assert all(isinstance(f, RequestFailedError) for f in failures)
    assert not engine.is_alive() and not engine._threads[0].is_alive()
    assert isinstance(engine.error, StepFailedError) and dead == [engine.error]
    with pytest.raises(EngineDeadError):
        engine.start()

    def tokenize(*args, **kwargs):
        raise AssertionError("a dead engine tokenized a prompt")

    monkeypatch.setattr(engine, "process_prompt", tokenize)
    usage = Future()
    error = run(failure_of(engine, "hello", usage=usage))
    assert isinstance(error, EngineDeadError) and error.__cause__ is engine.error
    assert usage.result(timeout=1).completion_tokens == 0
    assert dead == [engine.error]


def test_an_error_outside_a_step_kills_the_engine_and_tells_every_consumer(config, monkeypatch) -> None:
    dead: list[BaseException] = []
    engine = AsyncLLMEngine(config, progress=False, on_dead=dead.append)
    inner = engine.engine.stats
    armed = threading.Event()

    def flaky():
        if armed.is_set():
            raise OSError("metrics broke")
        return inner()

    monkeypatch.setattr(engine.engine, "stats", flaky)

    async def main():
        usages = [Future(), Future()]
        streams = [engine.generate(p, LONG, usage=u) for p, u in zip(PROMPTS[:2], usages, strict=True)]
        received = [len((await anext(s)).outputs[0].token_ids) for s in streams]
        armed.set()
        errors = []
        for stream in streams:
            try:
                async for out in stream:
                    received[len(errors)] += len(out.outputs[0].token_ids)
            except EngineDeadError as error:
                errors.append(error)
        return received, errors, [await asyncio.wrap_future(u) for u in usages]

    received, errors, usages = run(main())
    engine._threads[0].join(10)  # on_dead runs last, after every stream was told
    assert len(errors) == 2 and all(isinstance(e.__cause__, OSError) for e in errors)
    assert all(u.completion_tokens >= r for u, r in zip(usages, received, strict=True))
    assert not engine.is_alive() and isinstance(engine.error, OSError) and dead == [engine.error]
    with pytest.raises(EngineDeadError):
        engine.start()
