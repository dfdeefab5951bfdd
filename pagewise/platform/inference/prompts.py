"""Turn an OpenAI body into engine input, checking everything before any state changes.

Invariant: `prepare_*` either raises an `APIError` (400/404) or returns a request the engine will accept —
so admission never reserves quota or writes a row for a request that was bound to be rejected.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

from pagewise.engine.errors import InvalidRequestError, PromptTooLongError
from pagewise.engine.sampling_params import SamplingParams
from pagewise.platform.engine_client import EngineClient
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.inference.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from pagewise.platform.keys.auth import Principal

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
Endpoint = Literal["chat.completions", "completions"]


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

    @property
    def reserved_tokens(self) -> int:
        """What admission reserves: every prompt plus `max_tokens` for each of its `n` samples."""
        return sum(len(p) + self.params.n * self.params.max_tokens for p in self.prompts)

    def params_record(self) -> dict[str, Any]:
        record = dataclasses.asdict(self.params)
        record.pop("stop_strings", None)
        return record


def prepare_chat(body: ChatCompletionRequest, principal: Principal, engine: EngineClient) -> PreparedRequest:
    _check_model(body.model, engine)
    if not body.messages:
        raise invalid_request("messages must contain at least one message", param="messages")
    messages = [{"role": m.role, "content": _message_text(m.content, i)} for i, m in enumerate(body.messages)]
    try:
        prompt = engine.encode_chat(messages)
    except ValueError as error:
        raise invalid_request(
            f"messages cannot be rendered by the chat template: {error}", "messages"
        ) from None
    logprobs = None
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    elif body.top_logprobs is not None:
        raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    params = _sampling_params(
        body, [prompt], principal, engine, max_tokens, default_max_tokens=None, logprobs=logprobs
    )
    return PreparedRequest(
        "chat.completions",
        body.model,
        {"messages": messages},
        [prompt],
        params,
        body.stream,
        _include_usage(body),
    )


def prepare_completion(
    body: CompletionRequest, principal: Principal, engine: EngineClient
) -> PreparedRequest:
    _check_model(body.model, engine)
    prompts = [p if isinstance(p, list) else engine.encode(p) for p in _split_prompts(body.prompt)]
    if body.logprobs is not None and not 0 <= body.logprobs <= 5:
        raise invalid_request("logprobs must be between 0 and 5", param="logprobs")
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
        "completions", body.model, {"prompt": body.prompt}, prompts, params, body.stream, _include_usage(body)
    )


def _check_model(model: str, engine: EngineClient) -> None:
    if model != engine.model_name:
        raise APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{engine.model_name}'",
            code="model_not_found",
            param="model",
        )


def _include_usage(body: _SamplingFields) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _message_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise invalid_request("only text content parts are supported", param=f"messages[{index}].content")
        parts.append(part["text"])
    return "".join(parts)


def _split_prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    """A completions `prompt`: a string, strings, a list of token ids, or lists of token ids."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
        return list(prompt)
    raise invalid_request(
        "prompt must be a non-empty string, list of strings, list of token ids or list of token-id lists",
        param="prompt",
    )


def _sampling_params(
    body: _SamplingFields,
    prompts: list[list[int]],
    principal: Principal,
    engine: EngineClient,
    max_tokens: int | None,
    default_max_tokens: int | None,
    logprobs: int | None,
) -> SamplingParams:
    """Check tenant limits and the context window, then build (and engine-validate) the parameters."""
    if body.n < 1:
        raise invalid_request(f"n must be at least 1; got {body.n}", param="n")
    if principal.max_n is not None and body.n > principal.max_n:
        raise invalid_request(f"n={body.n} exceeds this tenant's limit of {principal.max_n}", param="n")
    tenant_cap = principal.max_tokens_per_request
    if max_tokens is not None and tenant_cap is not None and max_tokens > tenant_cap:
        raise invalid_request(
            f"max_tokens={max_tokens} exceeds this tenant's limit of {tenant_cap}", param="max_tokens"
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
        max_tokens = (
            window - longest if default_max_tokens is None else min(default_max_tokens, window - longest)
        )
        if tenant_cap is not None:
            max_tokens = min(max_tokens, tenant_cap)
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
            stop=stop,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
        )
        for prompt in prompts:
            engine.validate(prompt, params)
    except PromptTooLongError as error:
        raise APIError(400, str(error), code="context_length_exceeded") from None
    except InvalidRequestError as error:
        raise invalid_request(str(error)) from None
    return params
