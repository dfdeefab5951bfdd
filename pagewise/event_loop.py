"""The event loop long-running processes (`pagewise serve`'s uvicorn, `pagewise worker`) run on.

uvloop where it is installed (a dependency on every platform it supports), else asyncio's own: every await that
crosses a thread (database drivers, the engine's deliveries) pays a loop wake-up, and uvloop's costs a fraction
of the selector loop's. uvicorn makes the same choice for the server by itself (`loop="auto"`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the fastest loop available."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)
