"""Errors the engine raises.

Bad input (``InvalidRequestError``, ``InvalidConfigError``) is rejected before it changes any state. At run time
a failure is contained to the smallest scope that can be trusted afterwards: one request
(``RequestFailedError``), the requests of one step (``StepFailedError``), or — when that is not enough — the
whole engine (``EngineDeadError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagewise.engine.outputs import RequestOutput


class InvalidRequestError(ValueError):
    """A request or its parameters are invalid; the message says which and why, `param` names the field."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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


class RequestFailedError(RuntimeError):
    """One request failed inside the engine (its blocks are freed); the message says what failed and
    ``__cause__`` is the original exception. Other requests are unaffected."""


class StepFailedError(RuntimeError):
    """Batch-wide work of one step (scheduling, the forward pass) failed. Every request of that step has been
    failed and freed; ``outputs`` holds their final outputs (each with ``error`` set). The engine is consistent
    and can keep stepping."""

    def __init__(self, message: str, outputs: list[RequestOutput]) -> None:
        super().__init__(message)
        self.outputs = outputs


class EngineDeadError(RuntimeError):
    """The engine stopped after an error it could not contain; ``__cause__`` is that error."""
