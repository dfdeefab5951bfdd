"""The platform's only door to the engines: a tokenizer and the engines' limits, plus a transport.

Routes validate and tokenize with `EngineClient` and never touch an engine: the API replica of the distributed
mode loads no model (and imports no torch). Requests cross a `Transport` as `pagewise.serving.protocol` messages:

- `LoopbackTransport` (embedded mode): the engine runs in this process, behind the same messages;
- `RedisTransport` (distributed mode): Submits go to `pagewise worker` processes over Redis Streams.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from pagewise.engine.limits import check_prompt
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.tokenizer import Tokenizer
from pagewise.platform.errors import APIError
from pagewise.serving.protocol import EngineInfo, Event, Submit, WorkerHeartbeat


class Transport(Protocol):
    """Carries protocol messages between this API process and the engines."""

    def engine_info(self) -> EngineInfo | None:
        """What the engines serve; `None` until one has announced itself."""
        ...

    def tokenizer(self) -> Tokenizer | None: ...

    async def start(self) -> None: ...

    async def close(self) -> None:
        """Stop; in-process engines settle what they run first."""
        ...

    def check_capacity(self, tenant_id: str) -> None:
        """Raise a 503 `APIError` (with Retry-After) when no engine can take one more request of `tenant_id` now."""
        ...

    async def submit(self, submit: Submit) -> None:
        """Hand an admitted request to an engine; raises a 503 `APIError` if none can take it."""
        ...

    def events(self, request_id: str) -> AsyncIterator[Event]:
        """The request's events from its first one, ending after the terminal one. Any replica may read them,
        as often as it likes (a reconnecting client replays). Ends early only if the events expired."""
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel the request wherever it is (queued, running, or not yet delivered); idempotent."""
        ...

    def stats(self) -> dict[str, Any]:
        """Engine counters and gauges (summed over workers in distributed mode)."""
        ...

    def workers(self) -> list[WorkerHeartbeat]:
        """The live engines."""
        ...

    def error(self) -> BaseException | None:
        """Why serving is impossible for good (an in-process engine died); `None` otherwise."""
        ...


def engine_unavailable() -> APIError:
    """No engine has announced the model yet (distributed mode, before the first worker)."""
    return APIError(
        503, "No engine worker has announced the model yet; retry shortly", code="engine_unavailable",
        headers={"Retry-After": "5"},
    )


class EngineClient:
    """Tokenizer, limits and transport of the model this API serves."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    @property
    def info(self) -> EngineInfo:
        info = self.transport.engine_info()
        if info is None:
            raise engine_unavailable()
        return info

    @property
    def model_name(self) -> str:
        return self.info.model

    @property
    def model_names(self) -> tuple[str, ...]:
        """Every name a request may use for the model: its listed name, then its aliases."""
        info = self.info
        return (info.model, *info.aliases)

    @property
    def max_model_len(self) -> int:
        return self.info.limits.max_model_len

    def _tokenizer(self) -> Tokenizer:
        tokenizer = self.transport.tokenizer()
        if tokenizer is None:
            raise engine_unavailable()
        return tokenizer

    def encode(self, text: str) -> list[int]:
        return self._tokenizer().encode(text)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self._tokenizer().apply_chat_template(messages, add_generation_prompt=True)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise the engine's `InvalidRequestError` for input the engines would reject; changes nothing."""
        check_prompt(prompt_token_ids, params, self.info.limits)

    def stats(self) -> dict[str, Any]:
        return self.transport.stats()

    def is_ready(self) -> bool:
        """An engine can serve: the model is announced, an engine is live, none died for good."""
        return self.transport.error() is None and self.transport.engine_info() is not None and bool(
            self.transport.workers()
        )

    @property
    def error(self) -> BaseException | None:
        return self.transport.error()
