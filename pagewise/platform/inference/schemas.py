"""OpenAI request and response bodies (msgspec).

Request bodies are strict: an unknown or unsupported field is a 400 naming it (never silently ignored), numbers
are never parsed from strings (`pagewise.platform.bodies`), and every value is bounded so nothing a client sends
can overflow a column or make a row unreasonably large. Sampling ranges the engine checks (finite floats,
penalties, seeds) are checked once, by the engine's `SamplingParams`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from pagewise.engine.limits import MAX_PRIORITY

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


FunctionName = Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]{1,64}$")]
MAX_TOOLS = 128


class FunctionCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: FunctionName
    arguments: str  # a JSON object, as text (OpenAI's shape)


class ToolCall(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    id: Annotated[str, msgspec.Meta(max_length=256)]
    function: FunctionCall
    type: Literal["function"] = "function"


class ChatMessage(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], msgspec.Meta(max_length=MAX_TOOLS)] | None = None  # an assistant's
    tool_call_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None  # a tool message's


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class NamedFunction(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    function: NamedFunction
    type: Literal["function"] = "function"


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """OpenAI's `response_format.json_schema`. The schema is always enforced, `strict` or not: a keyword the
    grammar library cannot enforce is a 400 naming it."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern="^[A-Za-z0-9_-]+$")]
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="json_object"):
    pass


class JsonSchemaResponseFormat(
    msgspec.Struct, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="json_schema"
):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class StructuredOutputsBody(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """vLLM's `structured_outputs` request field: exactly one of a JSON Schema, a regex, a choice list, a Lark
    grammar or any JSON object."""

    json: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by both endpoints. Beyond OpenAI's: vLLM's `top_k`, `min_p`, `ignore_eos`,
    `repetition_penalty`, `min_tokens`, `stop_token_ids`, `include_stop_str_in_output` and `structured_outputs`."""

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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    priority: Annotated[int, msgspec.Meta(ge=-MAX_PRIORITY, le=MAX_PRIORITY)] = 0


class ChatCompletionRequest(_SamplingFields, kw_only=True, forbid_unknown_fields=True):
    messages: list[ChatMessage]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: Annotated[list[Tool], msgspec.Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


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


class AssistantMessage(msgspec.Struct, omit_defaults=True):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


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


class FunctionDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """A piece of one call in a streamed chunk, OpenAI's shape: a call's first piece carries its `id`, `type` and
    name; later pieces the next fragment of its `arguments` (clients join them by `index`)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
