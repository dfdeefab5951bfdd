"""The platform's only door to the engine.

Routes depend on the `EngineClient` protocol, never on `AsyncLLMEngine`: the in-process client below wraps an
engine in this process (embedded mode), and a Redis-Streams client can replace it without touching a route.
Everything crossing the protocol is a msgspec Struct (or the engine's `SamplingParams` dataclass), so it
can be serialized onto a stream unchanged.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pagewise.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagewise.engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # only the in-process client holds an engine; importing this module loads no torch
    from pagewise.engine.async_engine import AsyncLLMEngine


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    token: str
    logprob: float


class PositionLogprobs(msgspec.Struct, frozen=True):
    """One generated position: the sampled token and the `top` alternatives, most likely first."""

    chosen: TokenLogprob
    top: list[TokenLogprob]


class ChoiceDelta(msgspec.Struct, frozen=True):
    """What one sample (`index`) produced since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[PositionLogprobs] | None = None


class GenerationDelta(msgspec.Struct, frozen=True):
    """One step's news for one request; `finished` is set on the last delta, once every sample is done."""

    choices: list[ChoiceDelta]
    prompt_tokens: int
    cached_tokens: int
    finished: bool


class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    def encode(self, text: str) -> list[int]: ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]: ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the engine's `InvalidRequestError` for input it would reject; changes nothing."""
        ...

    def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant_id: str,
        usage: concurrent.futures.Future | None = None,
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[GenerationDelta]:
        """Deltas for one request. Leaving the iterator early aborts the request and frees its blocks.
        `tenant_weight` is the tenant's share of the engine under the fair scheduling policy.

        Once iteration has begun, `usage` is resolved exactly once with what the engine computed for the request
        (`prompt_tokens`, `cached_tokens`, `completion_tokens`) when it leaves the engine for any reason.
        """
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> dict[str, float | int]: ...

    def is_ready(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    def start(self) -> None: ...

    def shutdown(self) -> None: ...


class InProcessEngineClient:
    """`EngineClient` over an `AsyncLLMEngine` in this process; `owns_engine` decides who shuts it down."""

    def __init__(self, engine: AsyncLLMEngine, *, owns_engine: bool = True) -> None:
        self._engine = engine
        self._owns_engine = owns_engine
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len

    def encode(self, text: str) -> list[int]:
        return self._engine.tokenizer.encode(text)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._engine.engine.process_prompt(prompt_token_ids, params)

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str,
        tenant_id: str,
        usage: concurrent.futures.Future | None = None,
        tenant_weight: float = 1.0,
    ) -> AsyncIterator[GenerationDelta]:
        stream = self._engine.generate(
            prompt_token_ids,
            params,
            request_id=request_id,
            tenant_id=tenant_id,
            usage=usage,
            tenant_weight=tenant_weight,
        )
        try:
            async for output in stream:
                yield _delta(output, params.logprobs)
        finally:
            await stream.aclose()

    async def abort(self, request_id: str) -> None:
        self._engine.abort(request_id)

    def stats(self) -> dict[str, float | int]:
        return self._engine.stats()

    def is_ready(self) -> bool:
        """The model is loaded (the constructor did it) and the engine's loop has not died."""
        return self._engine.error is None

    @property
    def error(self) -> BaseException | None:
        """Why the engine's loop died; `None` while it is healthy."""
        return self._engine.error

    def start(self) -> None:
        self._engine.start()

    def shutdown(self) -> None:
        if self._owns_engine:
            self._engine.shutdown()


def _delta(output: RequestOutput, num_logprobs: int | None) -> GenerationDelta:
    return GenerationDelta(
        choices=[
            _choice(c, num_logprobs) for c in output.outputs if c.token_ids or c.text or c.finish_reason
        ],
        prompt_tokens=len(output.prompt_token_ids),
        cached_tokens=output.num_cached_tokens,
        finished=output.finished,
    )


def _choice(c: CompletionOutput, num_logprobs: int | None) -> ChoiceDelta:
    logprobs = None
    if num_logprobs is not None and c.logprobs is not None:
        logprobs = [
            _position(tid, pos, num_logprobs) for tid, pos in zip(c.token_ids, c.logprobs, strict=True)
        ]
    return ChoiceDelta(c.index, c.text, list(c.token_ids), c.finish_reason, logprobs)


def _position(token_id: int, candidates: dict[int, Logprob], k: int) -> PositionLogprobs:
    def entry(tid: int, lp: Logprob) -> TokenLogprob:
        return TokenLogprob(tid, lp.decoded_token or "", lp.logprob)

    ranked = sorted(candidates.items(), key=lambda item: item[1].rank)
    return PositionLogprobs(
        chosen=entry(token_id, candidates[token_id]), top=[entry(tid, lp) for tid, lp in ranked[:k]]
    )
