"""OpenAI response bodies and SSE chunks from a job's state — the one place these shapes are built."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import anyio
import msgspec
from litestar.response import Stream
from litestar.types import Receive, Scope, Send

from pagewise.platform.errors import as_api_error
from pagewise.platform.inference.job import InferenceJob
from pagewise.platform.inference.schemas import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    FunctionDelta,
    PromptTokensDetails,
    ToolCall,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from pagewise.platform.inference.tools import CallPiece, CallReader, might_be_calls, new_call_id, parse_calls
from pagewise.serving.protocol import ChoiceDelta, ChoiceSoFar, PositionLogprobs, TokenLogprob

_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def usage(job: InferenceJob) -> Usage:
    billed = job.usage
    return Usage(
        billed.prompt_tokens, billed.completion_tokens, billed.total, PromptTokensDetails(billed.cached_tokens)
    )


def _top(entry: TokenLogprob) -> TopLogprob:
    return TopLogprob(entry.token, entry.logprob, list(entry.token.encode()))


def chat_logprobs(positions: list[PositionLogprobs]) -> ChatLogprobs:
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                p.chosen.token, p.chosen.logprob, list(p.chosen.token.encode()), [_top(t) for t in p.top]
            )
            for p in positions
        ]
    )


def completion_logprobs(positions: list[PositionLogprobs], offset: int) -> CompletionLogprobs:
    tokens = [p.chosen.token for p in positions]
    offsets = []
    for token in tokens:
        offsets.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[p.chosen.logprob for p in positions],
        top_logprobs=[{t.token: t.logprob for t in p.top} for p in positions],
        text_offset=offsets,
    )


def chat_completion(job: InferenceJob, choices: list[ChoiceSoFar]) -> ChatCompletion:
    wants_logprobs = job.prepared.params.logprobs is not None
    answers = []
    for c in choices:
        message, finish_reason = _answer(job, c.full_text, c.finish_reason)
        answers.append(ChatChoice(c.index, message, chat_logprobs(c.logprobs) if wants_logprobs else None,
                                  finish_reason))
    return ChatCompletion(id=job.id, created=job.created, model=job.prepared.model, usage=usage(job), choices=answers)


def _answer(job: InferenceJob, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
    """A finished choice as the assistant's message: its calls (`finish_reason` `tool_calls`) when it made calls of
    offered functions, else its text."""
    plan = job.prepared.tools
    calls = parse_calls(text, plan) if plan is not None and finish_reason == "stop" else None
    if calls is None:
        return AssistantMessage("assistant", text), finish_reason
    return AssistantMessage("assistant", None, calls), "tool_calls"


def completion(job: InferenceJob, choices: list[ChoiceSoFar]) -> Completion:
    wants_logprobs = job.prepared.params.logprobs is not None
    return Completion(
        id=job.id,
        created=job.created,
        model=job.prepared.model,
        usage=usage(job),
        choices=[
            CompletionChoice(
                c.index,
                c.full_text,
                completion_logprobs(c.logprobs, 0) if wants_logprobs else None,
                c.finish_reason,
            )
            for c in choices
        ],
    )


def _event(payload: msgspec.Struct) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def _is_news(delta: ChoiceDelta) -> bool:
    return bool(delta.text or delta.finish_reason or delta.logprobs)


async def chat_events(job: InferenceJob) -> AsyncIterator[bytes]:
    """SSE for a streamed chat completion: a role chunk per choice, content deltas, usage if asked, [DONE]."""
    wants_logprobs = job.prepared.params.logprobs is not None

    def chunk(choices: list[ChatChunkChoice], final_usage: Usage | None = None) -> bytes:
        return _event(ChatCompletionChunk(job.id, job.created, job.prepared.model, choices, final_usage))

    for index in sorted(job.choices):
        yield chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""), None, None)])
    held = _HeldCalls(job)
    try:
        async with aclosing(job.run()) as deltas:
            async for d in deltas:
                if _is_news(d):
                    for choice in held.chunks(d, chat_logprobs(d.logprobs or []) if wants_logprobs else None):
                        yield chunk([choice])
    except Exception as exc:  # the status line is long gone: the error travels as an event
        yield _error_event(exc, job)
    else:
        if job.prepared.include_usage:
            yield chunk([], usage(job))
    yield _DONE


class _HeldCalls:
    """With functions offered, a streamed choice's text is held back while it may still be calls (it starts like
    `<tool_call>`); content from the moment it cannot be, or its calls, whole, in its last chunk. A constrained
    answer (`required`, a named function) is calls by construction: each call streams as it is generated, its
    name first, then its arguments in fragments (`tools.CallReader`). Without functions, every delta passes as
    it came."""

    def __init__(self, job: InferenceJob) -> None:
        self._job, self._plan = job, job.prepared.tools
        self._held: dict[int, list[ChoiceDelta]] = {}
        self._released: set[int] = set()
        self._readers: dict[int, CallReader] = {}
        self._ids: dict[tuple[int, int], str] = {}

    def chunks(self, d: ChoiceDelta, logprobs: ChatLogprobs | None) -> list[ChatChunkChoice]:
        if self._plan is None or d.index in self._released:
            return [ChatChunkChoice(d.index, ChatDelta(content=d.text) if d.text else ChatDelta(), logprobs,
                                    d.finish_reason)]
        if self._plan.constrained:
            return self._streamed_calls(d)
        held = self._held.setdefault(d.index, [])
        held.append(d)
        text = "".join(h.text for h in held)
        if d.finish_reason is None and (self._plan.constrained or might_be_calls(text)):
            return []
        del self._held[d.index]
        message, finish_reason = _answer(self._job, text, d.finish_reason)
        if message.tool_calls is None:
            self._released.add(d.index)
            whole = [p for h in held for p in h.logprobs or ()]
            lp = chat_logprobs(whole) if logprobs is not None else None
            return [ChatChunkChoice(d.index, ChatDelta(content=text) if text else ChatDelta(), lp, d.finish_reason)]
        calls = [_whole(i, c) for i, c in enumerate(message.tool_calls)]
        return [ChatChunkChoice(d.index, ChatDelta(tool_calls=calls), None, finish_reason)]

    def _streamed_calls(self, d: ChoiceDelta) -> list[ChatChunkChoice]:
        """A constrained choice's calls as they are generated; its whole text too, to read them at the end should
        the reader lose track (the calls not yet streamed then go out whole, in the last chunk)."""
        reader = self._readers.setdefault(d.index, CallReader())
        held = self._held.setdefault(d.index, [])
        held.append(d)
        pieces = [] if reader.lost else reader.feed(d.text)
        calls = [self._piece(d.index, p) for p in pieces]
        finish_reason = d.finish_reason
        if d.finish_reason is not None:
            text = "".join(h.text for h in self._held.pop(d.index))
            message, finish_reason = _answer(self._job, text, d.finish_reason)
            if reader.lost and message.tool_calls is not None:
                calls += [_whole(i, c) for i, c in enumerate(message.tool_calls) if i >= reader.calls]
        if not calls and finish_reason is None:
            return []
        return [ChatChunkChoice(d.index, ChatDelta(tool_calls=calls or None), None, finish_reason)]

    def _piece(self, choice: int, piece: CallPiece) -> ToolCallDelta:
        if piece.name is None:
            return ToolCallDelta(index=piece.index, function=FunctionDelta(arguments=piece.arguments))
        call_id = self._ids.setdefault((choice, piece.index), new_call_id())
        return ToolCallDelta(index=piece.index, id=call_id, type="function", function=FunctionDelta(name=piece.name,
                                                                                                    arguments=""))


def _whole(index: int, call: ToolCall) -> ToolCallDelta:
    function = FunctionDelta(name=call.function.name, arguments=call.function.arguments)
    return ToolCallDelta(index=index, id=call.id, type="function", function=function)


async def completion_events(job: InferenceJob) -> AsyncIterator[bytes]:
    """SSE for a streamed completion: text deltas, usage if asked, [DONE]."""
    wants_logprobs = job.prepared.params.logprobs is not None
    offsets = dict.fromkeys(job.choices, 0)
    try:
        async with aclosing(job.run()) as deltas:
            async for d in deltas:
                if _is_news(d):
                    logprobs = (
                        completion_logprobs(d.logprobs or [], offsets[d.index]) if wants_logprobs else None
                    )
                    offsets[d.index] += len(d.text)
                    body = Completion(
                        job.id,
                        job.created,
                        job.prepared.model,
                        [CompletionChoice(d.index, d.text, logprobs, d.finish_reason)],
                    )
                    yield _event(body)
    except Exception as exc:  # the status line is long gone: the error travels as an event
        yield _error_event(exc, job)
    else:
        if job.prepared.include_usage:
            yield _event(Completion(job.id, job.created, job.prepared.model, [], usage(job)))
    yield _DONE


def _error_event(exc: Exception, job: InferenceJob) -> bytes:
    """An error after the stream started: `data: {"error": {...}}` (what OpenAI and vLLM send)."""
    return _event(as_api_error(exc, f"streamed request {job.id}").body())


class SettlingStream(Stream):
    """The SSE response for one job; whatever ends the response ends the request.

    Litestar runs the event iterator in a task that a client disconnect cancels — possibly before the
    iterator's first step, when `job.run` (whose `finally` aborts the request) has not even started. So the
    ASGI response is wrapped: when it ends, for any reason, the iterator is closed and the request is aborted
    unless its end was seen; the engine then settles it as `cancelled`, billing the tokens it computed.
    """

    def __init__(self, job: InferenceJob, events: Callable[[InferenceJob], AsyncIterator[bytes]]) -> None:
        super().__init__(
            events(job), media_type="text/event-stream", headers={**SSE_HEADERS, **job.headers}
        )
        self.job = job

    def to_asgi_response(self, *args: Any, **kwargs: Any) -> Any:
        return _SettleAfter(super().to_asgi_response(*args, **kwargs), self.job, self.iterator)


class _SettleAfter:
    """An ASGI app: the wrapped response, then (shielded from cancellation) the request's end."""

    __slots__ = ("_events", "_job", "_response")

    def __init__(self, response: Any, job: InferenceJob, events: AsyncIterator[bytes]) -> None:
        self._response, self._job, self._events = response, job, events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self._response(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
                await self._job.end()
