"""OpenAI request and response bodies (msgspec).

Request bodies are strict: an unknown or unsupported field is a 400 naming it (never silently ignored), numbers
are never parsed from strings (`pagewise.platform.bodies`), and every value is bounded so nothing a client sends
can overflow a column or make a row unreasonably large. Sampling ranges the engine checks (finite floats,
penalties, seeds) are checked once, by the engine's `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

_INT32 = 2**31 - 1
PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=_INT32)]
Count = Annotated[int, msgspec.Meta(ge=0, le=_INT32)]
Name = Annotated[str, msgspec.Meta(max_length=256)]
StopString = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MAX_STOP = 16
MAX_PROMPTS = 256  # entries of a completions `prompt` list; tenant and engine limits usually bind first
MAX_MESSAGES = 2048  # messages of one chat request (each is rendered by the chat template)
MAX_CONTENT_PARTS = 4096  # content parts across a chat request's messages


class StreamOptions(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    include_usage: bool = False


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: Name | None = None


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints. Beyond OpenAI's: vLLM's `top_k`, `min_p`, `ignore_eos`,
    `repetition_penalty`, `min_tokens`, `stop_token_ids` and `include_stop_str_in_output`."""

    model: Name
    max_tokens: PositiveInt | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: PositiveInt = 1
    stop: StopString | Annotated[list[StopString], msgspec.Meta(max_length=MAX_STOP)] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    user: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    top_k: Annotated[int, msgspec.Meta(ge=-1, le=_INT32)] = 0
    min_p: float = 0.0
    min_tokens: Count = 0
    ignore_eos: bool = False
    stop_token_ids: list[Count] | None = None
    include_stop_str_in_output: bool = False


class ChatCompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None


class CompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    prompt: str | list[Any]
    """A string, a list of strings, a list of token ids, or a list of those (at most `MAX_PROMPTS` prompts; a
    token-id prompt is bounded by the context window, not here)."""
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=5)] | None = None


class AsyncChatRequest(ChatCompletionRequest, tag_field="endpoint", tag="/v1/chat/completions"):
    """`POST /v1/requests` with `"endpoint": "/v1/chat/completions"` and a chat body."""


class AsyncCompletionRequest(CompletionRequest, tag_field="endpoint", tag="/v1/completions"):
    """`POST /v1/requests` with `"endpoint": "/v1/completions"` and a completions body."""


AsyncRequest = AsyncChatRequest | AsyncCompletionRequest


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
