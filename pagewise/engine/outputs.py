"""What the engine returns: one ``RequestOutput`` per request, one ``CompletionOutput`` per sample, with the
request's milestones (``RequestMetrics``) and its lifecycle events in the engine (``RequestEvent``).

Times are ``time.monotonic()`` seconds taken on the engine's thread (``pagewise.engine.request_metrics`` says at
which point of a step each is taken); a consumer in the same process converts them to wall-clock time.
"""

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


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestUsage:
    """What a request cost, for billing; cumulative, all samples of the request together.

    Invariants: ``cached_tokens <= prompt_tokens <= len(prompt)``; no count ever decreases; a preempted request
    that recomputes its prompt is not charged twice.
    """

    prompt_tokens: int  # prompt positions the engine reached (prefix-cache hits included); len(prompt) once prefilled
    cached_tokens: int  # of those, served from the prefix cache when first reached
    completion_tokens: int  # every token generated, all samples, including ones no consumer received


NO_USAGE = RequestUsage(prompt_tokens=0, cached_tokens=0, completion_tokens=0)


@dataclass(frozen=True, slots=True)
class RequestMetrics:
    """When the request reached each milestone; ``None`` until it does. ``first_scheduled_time`` is the start of
    the step that first admitted it, ``first_token_time`` the end of the step that sampled its first token (any
    sample), ``finished_time`` the end of the step in which its last sample stopped — it stays ``None`` for a
    request that was aborted or failed. ``num_preemptions`` counts its samples' preemptions so far."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True, slots=True)
class Scheduled:
    """The step (``step``, the engine's step count, from 1) that first admitted the request: ``cached_tokens``
    of its prompt came from the prefix cache, and it held ``num_blocks`` KV blocks after the admission."""

    time: float
    step: int
    cached_tokens: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One step's share of a sample's prefill: ``num_tokens`` positions computed by the step that ran from
    ``start`` to ``end``. ``recompute``: the prefill recomputes a preempted sample's freed KV (its generated
    tokens included)."""

    start: float
    end: float
    step: int
    sample: int
    num_tokens: int
    recompute: bool


@dataclass(frozen=True, slots=True)
class Preempted:
    """A sample lost its place in the running batch at the start of step ``step``: ``mode`` ``"swap"`` (its KV
    moved to host memory) or ``"recompute"`` (its KV freed; it waits to be prefilled again)."""

    time: float
    step: int
    sample: int
    mode: str


@dataclass(frozen=True, slots=True)
class Resumed:
    """A preempted sample was scheduled again at the start of step ``step`` (``mode`` as it was preempted): it
    held ``num_blocks`` KV blocks then; after a recompute, ``cached_tokens`` of them came from the prefix cache."""

    time: float
    step: int
    sample: int
    mode: str
    cached_tokens: int
    num_blocks: int


RequestEvent = Scheduled | PrefillChunk | Preempted | Resumed


@dataclass(slots=True)
class RequestOutput:
    """A request's outputs: cumulative from ``LLMEngine``/``LLM``, deltas from ``AsyncLLMEngine``.

    ``usage`` and ``metrics`` (set on every output the engine makes) are cumulative on every output, delta or
    not; ``events`` follow the output's form (all of them so far, or only those since the previous output), in
    the order they happened. ``error`` is set only on the final output of a request that failed inside the
    engine (its unfinished samples end with ``finish_reason="error"``).
    """

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    usage: RequestUsage = NO_USAGE
    error: RequestFailedError | None = None
    metrics: RequestMetrics | None = None
    events: list[RequestEvent] = field(default_factory=list)
