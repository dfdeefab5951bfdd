"""What the engine returns: one ``RequestOutput`` per request, one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token; ``rank`` is 1 for the most likely token."""

    logprob: float
    rank: int
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. In a delta, ``text``/``token_ids``/``logprobs`` hold only what is new."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    stop_reason: str | int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs: cumulative from ``LLMEngine``/``LLM``, deltas from ``AsyncLLMEngine``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
