"""OpenAI request and response bodies (msgspec). Unknown request fields are ignored, as clients expect."""

from __future__ import annotations

from typing import Any, Literal

import msgspec


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by both endpoints; `top_k`, `min_p` and `ignore_eos` are vLLM's extensions."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: int = 0
    min_p: float = 0.0
    ignore_eos: bool = False


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    prompt: str | list[Any]  # a string, a list of strings, a list of token ids, or a list of those
    logprobs: int | None = None


class AsyncRequestEndpoint(msgspec.Struct, kw_only=True):
    """`POST /v1/requests` takes a chat or completions body plus the endpoint it is meant for."""

    endpoint: Literal["/v1/chat/completions", "/v1/completions"]


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class AssistantMessage(msgspec.Struct):
    role: Literal["assistant"]
    content: str


class ChatChoice(msgspec.Struct):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionChunk(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None


class Completion(msgspec.Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class Model(msgspec.Struct):
    id: str
    created: int
    owned_by: str
    max_model_len: int
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct):
    data: list[Model]
    object: Literal["list"] = "list"
