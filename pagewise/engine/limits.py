"""The checks a prompt and its parameters must pass before an engine takes them — with no model loaded.

The engine runs them on every request (`LLMEngine.process_prompt`); an API replica in distributed mode runs the
same function against a worker's published `EngineLimits`, so both refuse exactly the same requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagewise.engine.errors import InvalidRequestError, PromptTooLongError
from pagewise.engine.sampling_params import SamplingParams, is_int

MAX_PRIORITY = 1_000_000  # |priority| bound: vLLM's priorities are any integer; ours fit a key column
# named classes a key may be limited to (its best): interactive work by default, batch work one class below
PRIORITY_CLASSES = {"interactive": 0, "batch": 1}


def check_priority(priority: object) -> int:
    """A request's priority class (vLLM's: lower runs first): an integer within ``MAX_PRIORITY``."""
    if not is_int(priority) or abs(priority) > MAX_PRIORITY:  # type: ignore[arg-type]
        bound = f"{MAX_PRIORITY:,}"
        raise InvalidRequestError(f"priority must be an integer in [-{bound}, {bound}], got {priority!r}")
    return priority  # type: ignore[return-value]


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


class Limits(Protocol):
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    kv_capacity_tokens: int


@dataclass(frozen=True, slots=True)
class PromptLimits:
    """One engine's limits: its vocabulary, context window, batch width and whole KV cache in tokens."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    kv_capacity_tokens: int


def prompt_token_ids(
    prompt: str | Sequence[int], params: SamplingParams, tokenizer: _Encoder, limits: Limits
) -> list[int]:
    """Tokenize a text prompt (a token-id prompt is taken as is), check it with `check_prompt`, return its ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("prompt is empty")
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence):
        token_ids = list(prompt)
    else:
        raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
    check_prompt(token_ids, params, limits)
    return token_ids


def check_prompt(token_ids: list[int], params: SamplingParams, limits: Limits) -> None:
    """Raise `InvalidRequestError` (naming the parameter) unless `token_ids` with `params` can run.

    As vLLM v1, a prompt of `max_model_len` tokens or more is rejected: at least one token must fit after it.
    """
    vocab = limits.vocab_size
    bad = [t for t in token_ids if not is_int(t) or not 0 <= t < vocab]
    if bad:
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[0]!r}")
    if not token_ids:
        raise InvalidRequestError("prompt is empty")
    if len(token_ids) >= limits.max_model_len:
        raise PromptTooLongError(len(token_ids), limits.max_model_len)
    for name, token_id in params.token_ids_to_check():
        if token_id >= vocab:
            raise InvalidRequestError(f"{name} must be token ids in [0, {vocab}); got {token_id}")
    if params.n > limits.max_num_seqs:
        raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={limits.max_num_seqs}", param="n")
    need = min(len(token_ids) + params.max_tokens, limits.max_model_len)
    if need > limits.kv_capacity_tokens:
        raise InvalidRequestError(
            f"request needs up to {need:,} tokens of KV cache but the whole cache holds {limits.kv_capacity_tokens:,}; "
            "lower max_tokens or raise kv_cache_memory_bytes",
            param="max_tokens",
        )
