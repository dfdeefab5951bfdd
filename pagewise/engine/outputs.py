"""What the engine returns: one ``RequestOutput`` per request, one ``CompletionOutput`` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagewise.engine.errors import RequestFailedError


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


@dataclass(frozen=True, slots=True)
class RequestUsage:
    """What a request cost, for billing; cumulative, all samples of the request together.

    Invariants: ``cached_tokens <= prompt_tokens <= len(prompt)``; no count ever decreases; a preempted request
    that recomputes its prompt is not charged twice.
    """

    prompt_tokens: int  # prompt positions the engine reached (prefix-cache hits included); len(prompt) once prefilled
    cached_tokens: int  # of those, served from the prefix cache when first reached
    completion_tokens: int  # every token generated, all samples, including ones no consumer received


NO_USAGE = RequestUsage(0, 0, 0)


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs: cumulative from ``LLMEngine``/``LLM``, deltas from ``AsyncLLMEngine``.

    ``usage`` is cumulative on every output, delta or not. ``error`` is set only on the final output of a request
    that failed inside the engine (its unfinished samples end with ``finish_reason="error"``).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    usage: RequestUsage = NO_USAGE
    error: RequestFailedError | None = None
