"""Turn an OpenAI body into engine input, checking everything before any state changes.

Invariant: `prepare_*` either raises an `APIError` (400/404) or returns a request the engine will accept —
so admission never reserves quota or writes a row for a request that was bound to be rejected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import anyio
import msgspec

from pagewise.engine.errors import InvalidRequestError, PromptTooLongError
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.structured_outputs import StructuredOutputsParams
from pagewise.platform.engine_client import EngineClient
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.inference.schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    MAX_PROMPTS,
    ChatCompletionRequest,
    CompletionRequest,
    JsonObjectFormat,
    JsonSchemaResponseFormat,
    TextFormat,
    _SamplingFields,
)
from pagewise.platform.inference.tools import ToolPlan, plan_tools, render_message, system_prompt
from pagewise.platform.inference.tools import constraint as tool_constraint
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.admission import REQUEST_EXCEEDS_LIMIT
from pagewise.serving.protocol import AdapterRef

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Work up to this size is rendered and tokenized on the event loop: with the default model's chat template that
# takes no longer than the hand-off to a thread and back; more goes to a thread (its time grows with the text
# and with the number of messages the template renders), so no request holds the loop for long. A message
# counts as `MESSAGE_WORK_CHARS` characters on top of its text: the template's wrapper around each one.
INLINE_TOKENIZE_CHARS = 512
MESSAGE_WORK_CHARS = 32
Endpoint = Literal["chat.completions", "completions"]
T = TypeVar("T")


@dataclass(slots=True, frozen=True)
class PreparedRequest:
    """A validated request: token ids per prompt, engine parameters, and what to persist."""

    endpoint: Endpoint
    model: str
    input: dict[str, Any]
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    tools: ToolPlan | None = None  # a chat request's offered functions (`inference/tools.py`)
    priority: int = 0  # the engine's class for it: the body's, never better than the key's class allows
    adapter: AdapterRef | None = None  # the tenant's adapter `model` names (`<base>:<adapter>`), once resolved

    @property
    def base_model(self) -> str:
        """The served model's name as the request gave it (`model` without its `:<adapter>`)."""
        return self.model.partition(":")[0]

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: each prompt's `n` samples."""
        return len(self.prompts) * self.params.n

    @property
    def reserved_tokens(self) -> int:
        """What admission reserves: every prompt plus `max_tokens` for each of its `n` samples."""
        return sum(len(p) + self.params.n * self.params.max_tokens for p in self.prompts)

    def params_record(self) -> dict[str, Any]:
        record = dataclasses.asdict(self.params)
        record.pop("stop_strings", None)
        if record["structured_outputs"] is not None:  # the constraint as asked, not the grammar it compiled to
            record["structured_outputs"].pop("grammar_text", None)
        return record


async def prepare_chat(
    body: ChatCompletionRequest, principal: Principal, engine: EngineClient
) -> PreparedRequest:
    _check_model(body.model, engine)
    if not body.messages:
        raise invalid_request("messages must contain at least one message", param="messages")
    _check_sequences(principal, 1, body.n)
    logprobs = None
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    if len(body.messages) > MAX_MESSAGES:
        raise invalid_request(
            f"messages holds {len(body.messages):,} messages; at most {MAX_MESSAGES:,} per request", param="messages"
        )
    parts = sum(len(m.content) for m in body.messages if isinstance(m.content, list))
    if parts > MAX_CONTENT_PARTS:
        raise invalid_request(
            f"messages hold {parts:,} content parts; at most {MAX_CONTENT_PARTS:,} per request", param="messages"
        )
    try:
        tools = plan_tools(body)
    except InvalidRequestError as error:
        raise invalid_request(str(error), param=error.param) from None
    messages = _rendered_messages(body, tools)
    work = sum(len(m["content"]) for m in messages) + MESSAGE_WORK_CHARS * len(messages)
    try:
        prompt = await _tokenize(work, engine.encode_chat, messages)
    except ValueError as error:
        raise invalid_request(
            f"messages cannot be rendered by the chat template: {error}", "messages"
        ) from None
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(
        body, [prompt], principal, engine, max_tokens, default_max_tokens=None, logprobs=logprobs, tools=tools
    )
    return PreparedRequest(
        "chat.completions",
        body.model,
        {"messages": messages},
        [prompt],
        params,
        body.stream,
        _include_usage(body),
        tools,
        _priority(body, principal),
    )


def _rendered_messages(body: ChatCompletionRequest, tools: ToolPlan | None) -> list[dict[str, str]]:
    """The messages as the chat template gets them: text only, earlier calls and tool results in the call format,
    and the offered functions described in the system message."""
    messages = [
        render_message(m.role, _message_text(m.content, i), m.tool_calls) for i, m in enumerate(body.messages)
    ]
    if tools is not None:
        offer = system_prompt(tools)
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{offer}"}
        else:
            messages.insert(0, {"role": "system", "content": offer})
    return messages


async def prepare_completion(
    body: CompletionRequest, principal: Principal, engine: EngineClient
) -> PreparedRequest:
    _check_model(body.model, engine)
    split = _split_prompts(body.prompt)
    _check_sequences(principal, len(split), body.n)
    texts = [p for p in split if isinstance(p, str)]
    encoded = iter(await _tokenize(sum(map(len, texts)), _encode_all, engine, texts) if texts else ())
    prompts = [p if isinstance(p, list) else next(encoded) for p in split]
    params = _sampling_params(
        body,
        prompts,
        principal,
        engine,
        body.max_tokens,
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        logprobs=body.logprobs,
    )
    return PreparedRequest(
        "completions",
        body.model,
        {"prompt": body.prompt},
        prompts,
        params,
        body.stream,
        _include_usage(body),
        priority=_priority(body, principal),
    )


def _priority(body: _SamplingFields, principal: Principal) -> int:
    """vLLM's `priority` (lower runs first), lowered to the key's class when it asks for better."""
    return max(body.priority, principal.priority_floor)


async def _tokenize(work: int, encode: Callable[..., T], *args: Any) -> T:
    """`encode(*args)`: inline for work of at most `INLINE_TOKENIZE_CHARS` characters, else on a thread."""
    if work <= INLINE_TOKENIZE_CHARS:
        return encode(*args)
    return await anyio.to_thread.run_sync(encode, *args)


def _encode_all(engine: EngineClient, texts: list[str]) -> list[list[int]]:
    return [engine.encode(text) for text in texts]


def _check_model(model: str, engine: EngineClient) -> None:
    """The base model must be served here; an adapter named after it (`<base>:<adapter>`) is resolved at admission
    (`adapters.service.resolve_adapter`), where the database is."""
    if model.partition(":")[0] not in engine.model_names:
        raise model_not_found(model, engine)


def model_not_found(model: str, engine: EngineClient) -> APIError:
    """The 404 for a model this caller cannot use: not served here, or not one of its own adapters (another
    tenant's adapter gets exactly this answer)."""
    return APIError(
        404,
        f"The model '{model}' does not exist; this server serves '{engine.model_name}' and your adapters on it",
        code="model_not_found",
        param="model",
    )


def _check_sequences(principal: Principal, num_prompts: int, n: int) -> None:
    """Every prompt runs `n` sequences: their product counts against the tenant's `max_n` (checked before any
    tokenization, so an over-limit request costs the server nothing)."""
    if principal.max_n is None or num_prompts * n <= principal.max_n:
        return
    if num_prompts == 1:
        raise invalid_request(f"n={n} exceeds this tenant's limit of {principal.max_n}", param="n")
    raise invalid_request(
        f"{num_prompts} prompts x n={n} = {num_prompts * n} sequences exceed this tenant's limit of "
        f"{principal.max_n} (max_n counts every prompt's samples)",
        param="prompt",
    )


def _include_usage(body: _SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _message_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str) or set(part) != {"type", "text"}:
            raise invalid_request(
                "only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                param=f"messages[{index}].content",
            )
        parts.append(part["text"])
    return "".join(parts)


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completions `prompt`: a string, strings, a list of token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(_is_token(t) for t in prompt):
        return [prompt]
    many = bool(prompt) and (
        all(isinstance(p, str) for p in prompt)
        or all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt)
    )
    if many and len(prompt) > MAX_PROMPTS:
        raise invalid_request(f"prompt holds {len(prompt)} prompts; at most {MAX_PROMPTS} per request", param="prompt")
    if many:
        return list(prompt)
    raise invalid_request(
        "prompt must be a non-empty string, list of strings, list of token ids or list of token-id lists",
        param="prompt",
    )


def _default_max_tokens(
    prompts: list[list[int]], n: int, principal: Principal, room: int, default: int | None
) -> int:
    """`max_tokens` for a request that did not set it: what it can really use.

    Bounded by the context window (`room`), the endpoint's default, the tenant's per-request cap, and by the
    tenant's token limits: a reservation (every prompt plus `n x max_tokens` each) larger than the tokens-per-
    minute limit or the monthly budget could never be admitted, so the default shrinks to fit them. A prompt
    that alone leaves no room under such a limit is a 400 (it can never succeed), not a retryable 429.
    """
    bounds = [room] + [b for b in (default, principal.max_tokens_per_request) if b is not None]
    prompt_total, sequences = sum(len(p) for p in prompts), n * len(prompts)
    limits = principal.limits
    for field, limit in (
        ("tokens_per_minute", limits.tokens_per_minute),
        ("monthly_token_budget", limits.monthly_token_budget),
    ):
        if limit is None:
            continue
        fit = (limit - prompt_total) // sequences
        if fit < 1:
            raise APIError(
                400,
                f"The prompt needs {prompt_total:,} tokens, leaving no room for output under this tenant's "
                f"{field} limit of {limit:,}; shorten the prompt",
                code=REQUEST_EXCEEDS_LIMIT,
                param="prompt" if default is not None else "messages",
            )
        bounds.append(fit)
    return min(bounds)


def _logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI sends `logit_bias` keyed by token ids written as strings."""
    if raw is None:
        return None
    bias = {}
    for key, value in raw.items():
        if not key.isdigit() or len(key) > 10:
            raise invalid_request(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
        bias[int(key)] = value
    return bias


def _constraint(body: _SamplingFields, tools: ToolPlan | None) -> StructuredOutputsParams | None:
    """The output constraint of `response_format` (OpenAI's), `structured_outputs` (vLLM's) or a `required` or
    named `tool_choice`, at most one of them; what cannot be enforced is an `InvalidRequestError` naming the body's
    own field."""
    response_format, vllm_form = body.response_format, body.structured_outputs
    if isinstance(response_format, TextFormat):
        response_format = None
    if response_format is not None and vllm_form is not None:
        raise InvalidRequestError("give response_format or structured_outputs, not both", param="response_format")
    if tools is not None and tools.constrained:
        if response_format is not None or vllm_form is not None:
            raise InvalidRequestError("a required tool_choice already fixes the answer's format", param="tool_choice")
        return tool_constraint(tools)
    if vllm_form is not None:
        return StructuredOutputsParams(**msgspec.structs.asdict(vllm_form))
    if isinstance(response_format, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    if isinstance(response_format, JsonSchemaResponseFormat):
        schema = response_format.json_schema.schema
        try:
            return StructuredOutputsParams(json={} if schema is None else schema)
        except InvalidRequestError as error:
            message = str(error).replace("structured_outputs.json", "response_format.json_schema.schema")
            raise InvalidRequestError(message, param="response_format.json_schema.schema") from None
    return None


def _sampling_params(
    body: _SamplingFields,
    prompts: list[list[int]],
    principal: Principal,
    engine: EngineClient,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
    tools: ToolPlan | None = None,
) -> SamplingParams:
    """Check tenant limits and the context window, then build (and engine-validate) the parameters."""
    tenant_cap = principal.max_tokens_per_request
    if max_tokens is not None and tenant_cap is not None and max_tokens > tenant_cap:
        raise invalid_request(
            f"max_tokens={max_tokens} exceeds this tenant's limit of {tenant_cap}", param="max_tokens",
            code=REQUEST_EXCEEDS_LIMIT,
        )
    longest = max(len(p) for p in prompts)
    window = engine.max_model_len
    if longest >= window or (max_tokens is not None and longest + max_tokens > window):
        requested = f" plus max_tokens={max_tokens}" if max_tokens is not None else ""
        raise APIError(
            400,
            f"This model's maximum context length is {window:,} tokens; the prompt has "
            f"{longest:,} tokens{requested}. Shorten the prompt or lower max_tokens.",
            code="context_length_exceeded",
            param="messages" if default_max_tokens is None else "prompt",
        )
    if max_tokens is None:
        max_tokens = _default_max_tokens(prompts, body.n, principal, window - longest, default_max_tokens)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    try:
        params = SamplingParams(
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=stop,
            stop_token_ids=body.stop_token_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            logit_bias=_logit_bias(body.logit_bias),
            structured_outputs=_constraint(body, tools),
        )
        for prompt in prompts:
            engine.validate(prompt, params)
    except PromptTooLongError as error:
        raise APIError(400, str(error), code="context_length_exceeded") from None
    except InvalidRequestError as error:
        raise invalid_request(str(error), param=error.param) from None
    return params
