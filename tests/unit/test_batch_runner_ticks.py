"""The batch runner's pace: fast ticks while a batch is open, an idle wait otherwise that this process's own
new batch cuts short (each tick costs database round trips, which an idle server should not spend)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pagewise.platform.batches import runner


def ticks_of(monkeypatch, open_batches: list[bool], *, act) -> list[float]:  # noqa: ANN001
    """Run ``keep_running_batches`` (fast tick 0.01 s, idle tick 1 s) with each tick seeing an open batch as
    ``open_batches`` says (then none); ``act(services)`` runs beside it for 0.3 s. Returns the ticks' times."""
    times: list[float] = []

    async def run_once(services) -> bool:  # noqa: ANN001
        times.append(asyncio.get_running_loop().time())
        return open_batches.pop(0) if open_batches else False

    monkeypatch.setattr(runner, "run_batches_once", run_once)

    async def main() -> None:
        services = SimpleNamespace(batch_created=asyncio.Event())
        task = asyncio.create_task(runner.keep_running_batches(services, tick_s=0.01, idle_tick_s=1.0))
        await act(services)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    return [t - times[0] for t in times]


def test_open_batches_tick_fast_and_an_idle_runner_waits(monkeypatch) -> None:
    ticks = ticks_of(monkeypatch, [True, True, True], act=lambda services: asyncio.sleep(0.3))
    # three busy ticks close together, one idle tick, then nothing before the idle wait ends
    assert len(ticks) == 4 and ticks[3] < 0.25


def test_a_batch_created_here_wakes_the_idle_runner(monkeypatch) -> None:
    async def create(services) -> None:  # noqa: ANN001
        await asyncio.sleep(0.1)
        services.batch_created.set()
        await asyncio.sleep(0.2)

    ticks = ticks_of(monkeypatch, [], act=create)
    # the first (idle) tick, then ticks from the wake-up on, well before the 1 s idle wait would end
    assert len(ticks) > 3 and 0.09 < ticks[1] < 0.5
