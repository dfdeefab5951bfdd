"""pagewise: a multi-tenant LLM inference platform around a PagedAttention engine."""

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from pagewise.engine.config import EngineConfig
from pagewise.engine.llm import LLM
from pagewise.engine.llm_engine import LLMEngine
from pagewise.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagewise.engine.sampling_params import SamplingParams

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
    "RequestOutput",
    "SamplingParams",
]
