"""Loading this process's own engine from the settings, and the line that tells an operator what it serves. Used
by `pagewise serve` (embedded mode) and `pagewise worker`; importing this module loads neither torch nor
Litestar (the engine is imported when one is loaded)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagewise.platform.settings import Settings

if TYPE_CHECKING:
    from pagewise.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger("pagewise.platform")


def engine_problem(settings: Settings) -> str | None:
    """What is wrong with the engine settings (bad flags, no such model), checked before the model is loaded;
    `None` when nothing is. Imports torch: call it only where this process runs the engine."""
    from pagewise.engine.config import EngineConfig
    from pagewise.engine.errors import InvalidConfigError
    from pagewise.engine.loader import ModelNotFoundError, resolve_model_path

    try:
        EngineConfig(**settings.engine.engine_kwargs())
        resolve_model_path(settings.engine.model)
    except (InvalidConfigError, ModelNotFoundError) as error:
        return str(error)
    return None


def load_engine(settings: Settings, on_dead: Callable[[], None] | None = None) -> AsyncLLMEngine:
    """Load the model into an engine of this process's own (seconds to minutes; blocking): stepped in a child
    process, or with `engine_process` off in a thread of this one.

    If the engine's loop ever dies, the error is logged and `on_dead` is called (from the engine's thread):
    `pagewise serve` passes one that stops the server, then exits non-zero so a supervisor restarts it.
    """
    from pagewise.engine.async_engine import AsyncLLMEngine
    from pagewise.engine.config import EngineConfig

    def dead(error: BaseException) -> None:
        logger.critical("the engine stopped after an error; the server cannot serve: %r", error)
        if on_dead is not None:
            on_dead()

    config = EngineConfig(**settings.engine.engine_kwargs())
    return AsyncLLMEngine(config, on_dead=dead, process=settings.engine_process)


def engine_summary(engine: AsyncLLMEngine) -> str:
    """One line for an operator: what is served, in which dtype and on what, with how much KV cache."""
    config, limits, stats = engine.config, engine.limits, engine.stats()
    blocks = engine.num_blocks
    precision = ", ".join(f"{part} {dtype}" for part, dtype in stats["precision"].items())
    return (
        f"pagewise: serving {engine.model_name} (dtype {config.dtype}: {precision}; on {config.device}), max_model_len "
        f"{limits.max_model_len:,}, {blocks:,} KV blocks of {config.block_size} ({limits.kv_capacity_tokens:,} "
        f"tokens), max_num_seqs {limits.max_num_seqs}, {config.scheduling_policy} scheduling, matmul path "
        f"{stats['gemm_path']} (few-rows product up to {stats['gemm_few_rows']} rows)"
    )
