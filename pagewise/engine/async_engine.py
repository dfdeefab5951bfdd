"""``AsyncLLMEngine``: the engine stepped by one background thread, streamed to asyncio consumers.

The event loop never runs a model step: ``generate`` validates on the caller's thread (so bad input raises
there and changes nothing), then hands the request to the engine thread through an inbox; the thread pushes
each step's deltas back with ``call_soon_threadsafe``. Leaving ``generate`` early aborts the request.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.llm_engine import LLMEngine, PromptInput
from pagewise.engine.outputs import RequestOutput
from pagewise.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class EngineDeadError(RuntimeError):
    """The engine thread crashed; the message carries the original error."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.engine = LLMEngine(config, progress=progress)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self._inbox: deque[tuple] = deque()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self._stats = self.engine.stats()
        self._error: BaseException | None = None

    def start(self) -> None:
        """Start the stepping thread (idempotent)."""
        if self._thread is None or not self._thread.is_alive():
            self._stopping = False
            self._thread = threading.Thread(target=self._run, name="pagewise-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def stats(self) -> dict[str, float | int]:
        """A snapshot taken after the engine's latest step."""
        return dict(self._stats)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its blocks are freed on the engine thread's next turn."""
        self._post(("abort", request_id))

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield ``RequestOutput`` deltas for one request until it finishes."""
        if self._error is not None:
            raise EngineDeadError(f"engine stopped after an error: {self._error!r}")
        params = params or SamplingParams()
        request_id = request_id or f"req-{next(self._ids)}"
        token_ids = self.engine.process_prompt(prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._streams:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self.start()
        text = prompt if isinstance(prompt, str) else None
        self._post(("add", request_id, token_ids, text, params, tenant_id))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, InvalidRequestError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDeadError(f"engine stopped after an error: {item!r}") from item
                finished = item.finished
                yield item
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def _post(self, message: tuple) -> None:
        self._inbox.append(message)
        self._wake.set()

    def _run(self) -> None:
        engine = self.engine
        try:
            while not self._stopping:
                self._drain_inbox()
                if not engine.has_unfinished_requests():
                    self._stats = engine.stats()
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                outputs = engine.step()
                self._stats = engine.stats()
                for output in outputs:
                    self._deliver(output.request_id, output)
        except BaseException as error:  # noqa: BLE001 - every waiting stream must hear about a crash
            self._error = error
            with self._lock:
                streams = list(self._streams)
            for request_id in streams:
                self._deliver(request_id, error)
            raise

    def _drain_inbox(self) -> None:
        while self._inbox:
            message = self._inbox.popleft()
            if message[0] == "abort":
                final = self.engine.abort_request(message[1])
                if final is not None:
                    self._deliver(message[1], final)
                continue
            _, request_id, token_ids, text, params, tenant_id = message
            with self._lock:
                wanted = request_id in self._streams
            if not wanted:
                continue
            try:
                self.engine.add_request(
                    request_id, token_ids, params, tenant_id, delta=True, prompt_text=text
                )
            except InvalidRequestError as error:
                self._deliver(request_id, error)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop is closed: nobody is listening any more
            self._post(("abort", request_id))
