"""pagewise: a multi-tenant LLM inference platform around a PagedAttention engine.

The engine's public names are exported lazily: ``from pagewise import LLM`` loads torch and the engine, while
``import pagewise.platform`` (an API process) or ``import pagewise`` alone does not.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "AsyncLLMEngine": "pagewise.engine.async_engine",
    "BeamSearchOutput": "pagewise.engine.beam_search",
    "BeamSearchParams": "pagewise.engine.beam_search",
    "BeamSearchSequence": "pagewise.engine.beam_search",
    "CompletionOutput": "pagewise.engine.outputs",
    "EngineConfig": "pagewise.engine.config",
    "LLM": "pagewise.engine.llm",
    "LLMEngine": "pagewise.engine.llm_engine",
    "Logprob": "pagewise.engine.outputs",
    "LoRARequest": "pagewise.engine.lora_request",
    "RequestOutput": "pagewise.engine.outputs",
    "RequestUsage": "pagewise.engine.outputs",
    "SamplingParams": "pagewise.engine.sampling_params",
    "StructuredOutputsParams": "pagewise.engine.structured_outputs",
}
__all__ = [
    "LLM",
    "AsyncLLMEngine",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "LLMEngine",
    "Logprob",
    "LoRARequest",
    "RequestOutput",
    "RequestUsage",
    "SamplingParams",
    "StructuredOutputsParams",
]

if TYPE_CHECKING:
    from pagewise.engine.async_engine import AsyncLLMEngine
    from pagewise.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
    from pagewise.engine.config import EngineConfig
    from pagewise.engine.llm import LLM
    from pagewise.engine.llm_engine import LLMEngine
    from pagewise.engine.lora_request import LoRARequest
    from pagewise.engine.outputs import CompletionOutput, Logprob, RequestOutput, RequestUsage
    from pagewise.engine.sampling_params import SamplingParams
    from pagewise.engine.structured_outputs import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagewise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
