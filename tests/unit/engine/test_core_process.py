"""The engine in a child process (``AsyncLLMEngine(process=True)``): what only that form can do wrong — the child
killed mid-generation, a load that fails over there, a request the child refuses, Ctrl-C or SIGTERM reaching the whole
process group, shutdown. (Everything both forms share runs against both in ``test_async_engine.py``.)"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time
from concurrent.futures import Future

import pytest

from pagewise import AsyncLLMEngine, EngineConfig, SamplingParams
from pagewise.engine import core_process
from pagewise.engine.errors import EngineDeadError, InvalidConfigError, InvalidRequestError

BLOCK = 4
NUM_BLOCKS = 200
PROMPT = [5, 17, 42, 99, 123, 7, 300]
LONG = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module")
def config(paged_config) -> EngineConfig:
    return paged_config("core-process-llama", BLOCK, NUM_BLOCKS, max_num_seqs=4)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def tokens_of(engine: AsyncLLMEngine, prompt, params=SHORT, **kwargs) -> list[int]:
    return [t async for out in engine.generate(prompt, params, **kwargs) for t in out.outputs[0].token_ids]


def test_the_engine_steps_in_a_child_process_and_matches_the_thread(config) -> None:
    process = AsyncLLMEngine(config, progress=False, process=True)
    thread = AsyncLLMEngine(config, progress=False)
    try:
        assert process.engine is None and process.process_id not in (None, os.getpid())
        assert (process.limits, process.num_blocks, process.max_model_len) == (
            thread.limits, thread.num_blocks, thread.max_model_len)
        assert process.tokenizer.encode("hello there") == thread.tokenizer.encode("hello there")
        assert run(tokens_of(process, "hello there")) == run(tokens_of(thread, "hello there"))
    finally:
        process.shutdown()
        thread.shutdown()


def test_a_killed_child_fails_every_stream_settles_usage_and_calls_on_dead(config) -> None:
    dead: list[BaseException] = []
    engine = AsyncLLMEngine(config, progress=False, process=True, on_dead=dead.append)

    async def main():
        usage = Future()
        stream = engine.generate(PROMPT, LONG, usage=usage)
        received = len((await anext(stream)).outputs[0].token_ids)
        os.kill(engine.process_id, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match=r"engine process exited \(exit code -9\)"):
            async for out in stream:
                received += len(out.outputs[0].token_ids)
        return received, await asyncio.wrap_future(usage)

    try:
        received, usage = run(main())
        assert usage.prompt_tokens == len(PROMPT) and usage.completion_tokens >= received >= 1
        deadline = time.monotonic() + 10  # on_dead comes from the engine's thread after every stream was told
        while not dead and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not engine.is_alive() and dead == [engine.error]
        with pytest.raises(EngineDeadError):
            run(tokens_of(engine, PROMPT))
        with pytest.raises(EngineDeadError):
            engine.start()
    finally:
        engine.shutdown()


def test_a_load_that_fails_in_the_child_raises_its_error_here(config) -> None:
    too_small = EngineConfig(model=config.model, block_size=BLOCK, kv_cache_memory_bytes=1, dtype="float32")
    with pytest.raises(InvalidConfigError, match="kv_cache_memory_bytes=1 is too small"):
        AsyncLLMEngine(too_small, progress=False, process=True)


def test_a_request_the_child_refuses_fails_alone(config) -> None:
    engine = AsyncLLMEngine(config, progress=False, process=True)
    try:
        usage = Future()
        with pytest.raises(InvalidRequestError, match="tenant_weight"):
            run(tokens_of(engine, PROMPT, tenant_weight=0, usage=usage))
        assert usage.result(timeout=1).completion_tokens == 0
        assert engine.is_alive() and len(run(tokens_of(engine, PROMPT))) == SHORT.max_tokens
    finally:
        engine.shutdown()


def test_ctrl_c_and_sigterm_leave_the_child_running_and_shutdown_stops_it_for_good(config) -> None:
    """What reaches a whole process group (Ctrl-C, a supervisor's SIGTERM) is the parent's to act on."""
    engine = AsyncLLMEngine(config, progress=False, process=True)
    pid = engine.process_id
    try:
        assert len(run(tokens_of(engine, PROMPT))) == SHORT.max_tokens
        for sig in (signal.SIGINT, signal.SIGTERM):
            os.kill(pid, sig)
            time.sleep(0.2)
            assert len(run(tokens_of(engine, PROMPT))) == SHORT.max_tokens and engine.is_alive()
    finally:
        engine.shutdown()
    assert engine._core.exitcode == 0
    with pytest.raises(RuntimeError, match="shut down"):
        engine.start()


def _report_spin_count(outbox) -> None:  # noqa: ANN001 - a multiprocessing Connection; runs in the child
    outbox.send(os.environ.get("GOMP_SPINCOUNT"))


@pytest.mark.parametrize("preset", [None, "123"])
def test_the_child_gets_a_short_openmp_spin_unless_the_environment_sets_one(
    preset: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    if preset is None:
        monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    else:
        monkeypatch.setenv("GOMP_SPINCOUNT", preset)
    context = multiprocessing.get_context("spawn")
    inbox, outbox = context.Pipe(duplex=False)
    with core_process._child_environment():
        child = context.Process(target=_report_spin_count, args=(outbox,))
        child.start()
    assert inbox.recv() == (preset or core_process.CHILD_ENVIRONMENT["GOMP_SPINCOUNT"])
    child.join(30)
    assert os.environ.get("GOMP_SPINCOUNT") == preset  # the parent's environment is as it was
