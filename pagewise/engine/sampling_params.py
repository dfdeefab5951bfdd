"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagewise.engine.errors import InvalidRequestError

_MAX_LOGPROBS = 20


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Same names and meanings as vLLM's ``SamplingParams``.

    ``temperature == 0`` is greedy. ``top_k == 0`` (or -1) disables top-k. With ``seed`` set, a request's samples
    are reproducible regardless of what else runs in the batch; with ``n > 1`` sample ``i`` uses ``seed + i``.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self._validate()
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        else:
            self.stop_strings = tuple(self.stop or ())
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        if not isinstance(self.n, int) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not self.temperature >= 0:  # also rejects NaN
            fail(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            fail(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            fail(f"top_k must be an integer >= 0 (0 or -1 disables it), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            fail(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            fail(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            fail(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.logprobs is not None and not (
            isinstance(self.logprobs, int) and 0 <= self.logprobs <= _MAX_LOGPROBS
        ):
            fail(f"logprobs must be an integer in [0, {_MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            fail(f"seed must be an integer, got {self.seed!r}")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            fail("stop must be a non-empty string or a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            fail("stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` samples: ``n = 1`` and a distinct seed."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)
