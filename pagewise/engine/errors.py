"""Errors the engine raises for bad input. Raising one never changes engine state."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request or its parameters are invalid; the message says which and why."""


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the context window."""

    def __init__(self, num_tokens: int, max_model_len: int) -> None:
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
        super().__init__(
            f"prompt has {num_tokens:,} tokens; max_model_len is {max_model_len:,} "
            "(the prompt plus at least one generated token must fit)"
        )


class InvalidConfigError(ValueError):
    """An engine argument is invalid; the message names the argument."""
