"""A worker's heartbeat reports per-tenant queues under the fair policy (what tenant-fair backpressure reads),
and none under FCFS."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.config import EngineConfig
from pagewise.engine.sampling_params import SamplingParams
from pagewise.serving.host import EngineHost


async def _consume(stream) -> None:
    async with contextlib.aclosing(stream):
        async for _ in stream:
            pass


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_heartbeat_tenants_waiting(tiny_model, policy: str) -> None:
    path, _ = tiny_model("heartbeat-llama")
    asyncio.run(asyncio.wait_for(_check(str(path), policy), 60))


async def _check(path: str, policy: str) -> None:
    config = EngineConfig(model=path, scheduling_policy=policy, max_num_seqs=1, dtype="float32")
    engine = AsyncLLMEngine(config, progress=False)
    params = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    tenants = ["flood", "flood", "flood", "quiet"]
    tasks = [
        asyncio.create_task(_consume(engine.generate([5, 6, 7, 8 + i], params, f"r{i}", tenant)))
        for i, tenant in enumerate(tenants)
    ]
    try:
        host = EngineHost(engine, None, None)
        for _ in range(500):
            beat = host.heartbeat("w1", "m")
            if beat.running == 1 and beat.waiting == 3:
                break
            await asyncio.sleep(0.01)
        assert (beat.running, beat.waiting) == (1, 3)
        if policy == "fcfs":
            assert beat.tenants_waiting is None
        else:  # one of the flood's requests runs (it arrived first)
            assert beat.tenants_waiting == {"flood": 2, "quiet": 1}
    finally:
        for i in range(len(tenants)):
            engine.abort(f"r{i}")
        await asyncio.gather(*tasks, return_exceptions=True)
        engine.shutdown()
