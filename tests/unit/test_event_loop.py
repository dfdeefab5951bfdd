"""`pagewise.event_loop`: long-running processes run on uvloop where it is installed."""

from __future__ import annotations

import asyncio

import pytest

from pagewise import event_loop


def test_run_returns_the_coroutines_result_on_uvloop():
    uvloop = pytest.importorskip("uvloop")

    async def main() -> tuple[str, int]:
        return type(asyncio.get_running_loop()).__module__, 42

    module, value = event_loop.run(main())
    assert value == 42
    assert module.startswith(uvloop.__name__)


def test_run_propagates_the_coroutines_exception():
    async def main() -> None:
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        event_loop.run(main())
