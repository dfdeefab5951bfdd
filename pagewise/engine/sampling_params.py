"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.structured_outputs import StructuredOutputsParams

_MAX_LOGPROBS = 20
_SAMPLING_EPS = 1e-5  # temperatures below this are greedy (as vLLM): dividing by them overflows fp32
MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed takes at most a uint64
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 300
MAX_ABS_LOGIT_BIAS = 100


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool`` (``True`` is no token id, count or seed)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite_number(value: object) -> bool:
    if is_int(value):
        return True
    return isinstance(value, float) and math.isfinite(value)


def _fail(param: str, message: str) -> None:
    raise InvalidRequestError(message, param=param)


def _check_int(name: str, value: object, low: int, high: int | None = None, note: str = "") -> None:
    if not (is_int(value) and low <= value and (high is None or value <= high)):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        _fail(name, f"{name} must be an integer {allowed}{note}, got {value!r}")


def _check_number(
    name: str, value: object, low: float, high: float = math.inf, *, open_low: bool = False, open_high: bool = False
) -> None:
    """``value`` is a finite int or float in the range; NaN and infinities are rejected whatever the range."""
    ok = (
        _is_finite_number(value)
        and (low < value if open_low else low <= value)
        and (value < high if open_high else value <= high)
    )
    if not ok:
        if high == math.inf:
            allowed = f"> {low:g}" if open_low else f">= {low:g}"
        else:
            allowed = f"in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}"
        _fail(name, f"{name} must be a finite number {allowed}, got {value!r}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        _fail(name, f"{name} must be a bool, got {value!r}")


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens and when to stop. Same names and meanings as vLLM's ``SamplingParams``.

    A temperature below ``1e-5`` (``0`` included) is greedy. ``top_k == 0`` (or -1) disables top-k. With ``seed``
    set, a request's samples are reproducible regardless of what else runs in the batch; with ``n > 1`` sample
    ``i`` uses ``seed + i``. ``logit_bias`` is added to the logits before anything else (greedy included);
    ``repetition_penalty`` divides the positive logits (multiplies the negative ones) of every token in the
    prompt or the output so far. Until ``min_tokens`` tokens are generated, EOS and ``stop_token_ids`` cannot be
    sampled and stop strings are not looked for. A stop string or stop token ends the text without its own
    text unless ``include_stop_str_in_output``; a stop token's id always stays in ``token_ids``.

    Invariant: a constructed instance is valid — every number finite and in range, every count an ``int`` (not
    a ``bool``); the engine checks only what needs the model (token ids against the vocabulary).
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
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self._validate()
        self.stop_strings = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        # Own copies: a caller mutating its list or dict later cannot bypass validation.
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
        if self.top_k == -1:
            self.top_k = 0

    def _validate(self) -> None:
        _check_int("n", self.n, 1)
        _check_int("max_tokens", self.max_tokens, 1)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens, note=" (at most max_tokens)")
        _check_number("temperature", self.temperature, 0)
        _check_number("top_p", self.top_p, 0, 1, open_low=True)
        _check_int("top_k", self.top_k, -1, note=" (0 or -1 disables it)")
        _check_number("min_p", self.min_p, 0, 1)
        _check_number("presence_penalty", self.presence_penalty, -2, 2)
        _check_number("frequency_penalty", self.frequency_penalty, -2, 2)
        _check_number("repetition_penalty", self.repetition_penalty, 0, open_low=True)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, _MAX_LOGPROBS)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
            if self.seed + self.n - 1 > MAX_SEED:
                _fail(
                    "seed",
                    f"seed + n - 1 must be <= {MAX_SEED} (sample i uses seed + i), got seed={self.seed}, n={self.n}"
                )
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        self._validate_stops()
        self._validate_logit_bias()
        self._validate_structured_outputs()

    def _validate_structured_outputs(self) -> None:
        constraint = self.structured_outputs
        if constraint is None:
            return
        if not isinstance(constraint, StructuredOutputsParams):
            _fail("structured_outputs", f"structured_outputs must be a StructuredOutputsParams, got {constraint!r}")
        if self.min_tokens:
            # min_tokens forbids EOS exactly where a finished document allows nothing else
            _fail("min_tokens", "min_tokens cannot be combined with structured_outputs")

    def _validate_stops(self) -> None:
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if stops is not None:
            if not isinstance(stops, list | tuple) or any(not isinstance(s, str) or not s for s in stops):
                _fail("stop", "stop must be a non-empty string or a list of non-empty strings")
            if len(stops) > MAX_STOP_STRINGS:
                _fail("stop", f"stop has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
            longest = max(stops, key=len, default="")
            if len(longest) > MAX_STOP_STRING_CHARS:
                _fail(
                    "stop",
                    f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, got one of {len(longest)}",
                )
        ids = self.stop_token_ids
        if ids is not None:
            if not isinstance(ids, list | tuple) or any(not is_int(t) or t < 0 for t in ids):
                _fail("stop_token_ids", f"stop_token_ids must be a list of non-negative integers, got {ids!r}")
            if len(ids) > MAX_STOP_TOKEN_IDS:
                _fail("stop_token_ids", f"stop_token_ids has {len(ids)} ids; at most {MAX_STOP_TOKEN_IDS} are allowed")

    def _validate_logit_bias(self) -> None:
        bias = self.logit_bias
        if bias is None:
            return
        if not isinstance(bias, dict):
            _fail("logit_bias", f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
            _fail("logit_bias", f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed")
        for token_id, value in bias.items():
            if not is_int(token_id) or token_id < 0:
                _fail("logit_bias", f"logit_bias keys must be token ids (integers >= 0), got {token_id!r}")
            _check_number(f"logit_bias[{token_id}]", value, -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS)

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    def token_ids_to_check(self) -> list[tuple[str, int]]:
        """``(field, token id)`` for every token id these parameters name, for the engine's vocabulary check."""
        named = [("stop_token_ids", t) for t in self.stop_token_ids or ()]
        return named + [("logit_bias keys", t) for t in self.logit_bias or {}]

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of the ``index``-th of ``n`` samples: ``n = 1`` and a distinct seed."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)
