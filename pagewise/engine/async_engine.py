"""``AsyncLLMEngine``: the engine stepped by one background thread, streamed to asyncio consumers.

The event loop never runs a model step: ``generate`` validates on the caller's thread (so bad input raises
there and changes nothing), then hands the request to the engine thread through an inbox; the thread pushes
each step's deltas back with ``call_soon_threadsafe``. Leaving ``generate`` early aborts the request.

Ids. Every ``generate`` call gets an engine id of its own; the caller's id names it in outputs and in ``abort``
and is in use from ``generate`` until the stream ends or ``abort`` releases it. A late delivery or abort for an
old call therefore never reaches a new call that reuses its id.

Failures. A request that fails on its own (in ``add_request`` or in its share of a step) ends its stream with the
error — ``InvalidRequestError`` as is, anything else as ``RequestFailedError``. A failed step fails the requests
it touched and the loop goes on. ``MAX_FAILED_STEPS`` failed steps in a row, or any error outside a step, kill
the engine: every waiting stream gets ``EngineDeadError``, ``is_alive()`` turns False, ``error`` holds the cause,
``on_dead`` is called once from the engine thread (after every stream was told), and ``start()`` refuses from
then on.

Where the engine runs. By default one background thread of this process steps it. With ``process=True`` it
runs in a child process (``core_process``), so its Python never waits for this process's GIL; here two threads
remain: one feeds the child the inbox, one delivers what the child sends. Everything above holds in both forms;
in the child form a crashed or killed child is an error outside a step, a dead engine settles each live
request's usage with what its last delivered output reported, and ``shutdown`` is final (``start`` refuses after
it).

Usage. A ``usage`` future given to ``generate`` is resolved exactly once with the request's final
``RequestUsage`` when it leaves the engine for any reason — on the engine thread, or with zeros on the caller's
thread when ``generate`` rejects the request before handing it over (zeros too if it never entered the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass
from typing import Any, NamedTuple

from pagewise.engine.config import EngineConfig
from pagewise.engine.core_process import AddRefused, CoreDead, EngineCoreProcess, StepOutputs
from pagewise.engine.errors import EngineDeadError, InvalidRequestError, StepFailedError
from pagewise.engine.limits import PromptLimits, prompt_token_ids
from pagewise.engine.llm_engine import LLMEngine, PromptInput
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.outputs import NO_USAGE, RequestOutput, RequestUsage
from pagewise.engine.request_ids import call_id
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.step_loop import MAX_FAILED_STEPS, AbortRequest, AddRequest, add_request, run_steps

__all__ = ["AsyncLLMEngine", "EngineDeadError"]

_logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Call:
    """One ``generate`` call: the caller's id, its own engine id, its consumer's queue, its usage future, its
    prompt, and the usage its latest delivered output reported. (Its arrival, ``time.monotonic()`` when the call
    was made — so its queue time covers the inbox too — travels in its ``AddRequest``.)"""

    request_id: str
    engine_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    usage: Future | None
    prompt_token_ids: list[int]
    prompt: str | None
    usage_so_far: RequestUsage = NO_USAGE


class _Add(NamedTuple):
    """An inbox message: start ``call``'s request (the other one is ``AbortRequest``)."""

    call: _Call
    request: AddRequest


def _put_all(items: list[tuple[_Call, RequestOutput | BaseException]]) -> None:
    """On a consumer's event loop: put each item on its call's queue."""
    for call, item in items:
        call.queue.put_nowait(item)


def _resolve(usage: Future | None, value: RequestUsage) -> None:
    """Resolve a usage future unless it is already done (or its owner cancelled it)."""
    if usage is not None:
        with contextlib.suppress(InvalidStateError):
            usage.set_result(value)


class AsyncLLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        progress: bool = True,
        on_dead: Callable[[BaseException], None] | None = None,
        process: bool = False,
    ) -> None:
        """Load the model (blocking), in this process or, with ``process``, in a child process of its own."""
        self.config = config
        self.engine: LLMEngine | None = None  # the engine object itself, in this process only
        self._core: EngineCoreProcess | None = None
        if process:
            self._core = EngineCoreProcess(config, progress=progress)
            info = self._core.info
            self.tokenizer, self.model_name, self.max_model_len = info.tokenizer, info.model_name, info.max_model_len
            self.limits: PromptLimits = info.limits
            self.arch: ModelArchConfig = info.arch
            self.num_blocks: int = info.num_blocks
            self._stats = info.stats
        else:
            self.engine = LLMEngine(config, progress=progress)
            self.tokenizer, self.model_name = self.engine.tokenizer, self.engine.model_name
            self.max_model_len = self.engine.max_model_len
            self.limits = self.engine.limits
            self.arch = self.engine.arch
            self.num_blocks = self.engine.num_blocks
            self._stats = self.engine.stats()
        self._closed = False
        self._on_dead = on_dead
        self._inbox: deque[_Add | tuple[str, str]] = deque()
        self._lock = threading.Lock()  # guards _calls, _by_caller, _error, _threads, _closed, _in_engine
        self._calls: dict[str, _Call] = {}  # engine id -> call, while its consumer listens
        self._by_caller: dict[str, str] = {}  # caller id -> engine id, while the caller id is in use
        self._in_engine: dict[str, _Call] = {}  # calls whose request is in the engine (engine side only)
        self._wake = threading.Event()
        self._stopping = False
        self._threads: list[threading.Thread] = []
        self._ids = itertools.count()
        self._error: BaseException | None = None

    # ---- lifecycle

    @property
    def process_id(self) -> int | None:
        """The engine's child process, or None when it runs in this process."""
        return None if self._core is None else self._core.pid

    def start(self) -> None:
        """Start the stepping thread, or the child's feeding and delivering threads (idempotent). Raises
        ``EngineDeadError`` once the engine died: a loop never restarts on the state a crash left behind."""
        with self._lock:
            self._raise_if_dead()
            if self._closed:
                raise RuntimeError("the engine process was shut down")
            if not self._threads:
                self._stopping = False
                targets = [self._run] if self._core is None else [self._feed, self._pump]
                self._threads = [
                    threading.Thread(target=target, name=f"pagewise-engine-{target.__name__[1:]}", daemon=True)
                    for target in targets
                ]
                for thread in self._threads:
                    thread.start()

    def shutdown(self) -> None:
        """Stop stepping (a request still in the engine then gets no further output). An engine in this process
        can be started again; a child process is stopped for good."""
        with self._lock:
            self._stopping = True
            threads, self._threads = self._threads, []
            self._closed = self._core is not None
        self._wake.set()
        if self._core is not None and not threads:
            self._core.close()
        for thread in threads:
            thread.join(timeout=30)

    def process_prompt(self, prompt: PromptInput, params: SamplingParams) -> list[int]:
        """Validate a prompt and its parameters against this engine (no state change); return its token ids."""
        return prompt_token_ids(prompt, params, self.tokenizer, self.limits)

    def is_alive(self) -> bool:
        """False once the engine died of an error (see ``error``); a stopped or not yet started engine is alive."""
        return self._error is None

    @property
    def error(self) -> BaseException | None:
        """What killed the engine, or None."""
        return self._error

    def stats(self) -> dict[str, Any]:
        """A snapshot taken after the engine's latest step."""
        return dict(self._stats)

    # ---- requests

    def abort(self, request_id: str) -> None:
        """Abort the live call with the caller's ``request_id``, from any thread. The id is free for a new call
        at once; the old stream ends with an ``"abort"`` output once the engine thread frees its blocks."""
        with self._lock:
            engine_id = self._by_caller.pop(request_id, None)
        if engine_id is not None:
            self._post(AbortRequest(engine_id))

    async def generate(
        self,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        tenant_id: str | None = None,
        *,
        usage: Future | None = None,
        tenant_weight: float = 1.0,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield ``RequestOutput`` deltas for one request until it finishes, under ``lora_request``'s adapter if
        given (an adapter the engine cannot serve ends the stream with its ``InvalidRequestError``). ``usage``, if
        given, is resolved with the request's final ``RequestUsage`` however the request ends (see the module
        docstring) — once the stream is first iterated: like any async generator, a stream closed before that
        never ran at all. The request arrives (for its queue time and latencies) when the stream is first iterated.

        Close a stream you leave early (``aclose()`` or ``contextlib.aclosing``): a bare ``break`` leaves the
        abort, and the release of ``request_id``, to the event loop's finalizer."""
        arrival = time.monotonic()
        try:
            self._raise_if_dead()
            params = params or SamplingParams()
            token_ids = self.process_prompt(prompt, params)
            self.start()
        except BaseException:
            _resolve(usage, NO_USAGE)
            raise
        caller_id = request_id or f"req-{next(self._ids)}"
        text = prompt if isinstance(prompt, str) else None
        add = AddRequest(
            engine_id=call_id(caller_id, next(self._ids)),
            token_ids=token_ids,
            params=params,
            tenant_id=tenant_id,
            tenant_weight=tenant_weight,
            arrival_time=arrival,
            prompt_text=text,
            priority=priority,
            lora_request=lora_request,
        )
        call = _Call(caller_id, add.engine_id, asyncio.get_running_loop(), asyncio.Queue(), usage, token_ids, text)
        self._register(call, add)
        ended = False
        try:
            while not ended:
                item = await call.queue.get()
                if isinstance(item, BaseException):
                    ended = True
                    raise item
                ended = item.finished
                yield item
        finally:
            with self._lock:
                self._calls.pop(call.engine_id, None)
                if self._by_caller.get(caller_id) == call.engine_id:
                    del self._by_caller[caller_id]
            if not ended:
                self._post(AbortRequest(call.engine_id))

    def _register(self, call: _Call, add: AddRequest) -> None:
        """Register `call` and post its add, together under the lock (so an abort for it is always behind its
        add); a caller id still in use, or a dead engine, refuses it."""
        with self._lock:
            if self._error is not None or call.request_id in self._by_caller:
                _resolve(call.usage, NO_USAGE)
                self._raise_if_dead()
                raise InvalidRequestError(f"request id {call.request_id!r} is already in use")
            self._by_caller[call.request_id] = call.engine_id
            self._calls[call.engine_id] = call
            self._post(_Add(call, add))

    def _raise_if_dead(self) -> None:
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error!r}") from self._error

    def _post(self, message: _Add | AbortRequest) -> None:
        self._inbox.append(message)
        self._wake.set()

    # ---- the engine thread (an engine in this process)

    def _run(self) -> None:
        try:
            failure = self._step_until_stopped()
        except BaseException as error:  # noqa: BLE001 - every waiting stream must hear about a crash
            self._die(error, "an error outside a step")
            return
        if failure is not None:
            self._die(failure, f"{MAX_FAILED_STEPS} steps in a row failed")

    def _step_until_stopped(self) -> StepFailedError | None:
        """`run_steps` on this process's engine, fed by the inbox, until shutdown (None) or ``MAX_FAILED_STEPS``
        failed steps in a row (the last failure)."""
        return run_steps(self.engine, self._take_inbox, self._publish)

    def _take_inbox(self, idle: bool, outputs: list[RequestOutput]) -> bool:
        if idle and not self._inbox and not self._stopping:
            self._wake.wait(timeout=1.0)  # bounded: `run_steps` comes back, and the stats stay fresh
            self._wake.clear()
        while self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, _Add):
                self._add(message)
            else:
                final = self.engine.abort_request(message.engine_id)
                if final is not None:
                    outputs.append(final)
        return not self._stopping

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self._stats = self.engine.stats()
        if outputs:
            self._deliver(outputs)

    def _add(self, add: _Add) -> None:
        call = add.call
        with self._lock:
            listening = self._calls.get(call.engine_id) is call
        if not listening:  # the consumer left before the request got here
            _resolve(call.usage, NO_USAGE)
            return
        if (error := add_request(self.engine, add.request)) is not None:
            self._send(call, error)
            _resolve(call.usage, NO_USAGE)
            return
        self._in_engine[call.engine_id] = call

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """Send one step's engine outputs to their calls (the caller's id in place of the engine id, the prompt
        put back where it travelled without it); a final one releases its call, whose usage is resolved once the
        output is on its way."""
        sends: list[tuple[_Call, RequestOutput | BaseException]] = []
        settled: list[tuple[Future | None, RequestUsage]] = []
        for output in outputs:
            with self._lock:
                call = self._in_engine[output.request_id]
                if output.finished:
                    del self._in_engine[output.request_id]
            output.request_id = call.request_id
            if self._core is not None:
                output.prompt_token_ids, output.prompt = call.prompt_token_ids, call.prompt
            call.usage_so_far = output.usage
            sends.append((call, output if output.error is None else output.error))
            if output.finished:
                settled.append((call.usage, output.usage))
        self._send_all(sends)
        for usage, value in settled:
            _resolve(usage, value)

    def _send(self, call: _Call, item: RequestOutput | BaseException) -> None:
        self._send_all([(call, item)])

    def _send_all(self, sends: list[tuple[_Call, RequestOutput | BaseException]]) -> None:
        """Queue each item for its call's consumer, if it still listens: in order, with one wake-up per event
        loop (a step's outputs for 64 streams on one loop are one ``call_soon_threadsafe``, not 64)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Call, RequestOutput | BaseException]]] = {}
        with self._lock:
            for call, item in sends:
                if self._calls.get(call.engine_id) is call:
                    by_loop.setdefault(call.loop, []).append((call, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the consumers' event loop is closed: nobody is listening any more
                for call, _ in items:
                    self._post(AbortRequest(call.engine_id))

    def _die(self, error: BaseException, why: str) -> None:
        """Mark the engine dead, end every stream with ``EngineDeadError``, settle every usage, call ``on_dead``."""
        _logger.critical("the engine stopped: %s", why, exc_info=error)
        with self._lock:
            self._error = error
            calls = list(self._calls.values())
            in_engine, self._in_engine = self._in_engine, {}
        for engine_id, call in in_engine.items():
            so_far = self.engine.request_usage(engine_id) if self.engine is not None else None
            _resolve(call.usage, so_far or call.usage_so_far)
        while self._inbox:  # nothing new can be added once _error is set
            message = self._inbox.popleft()
            if isinstance(message, _Add):
                _resolve(message.call.usage, NO_USAGE)
        for call in calls:
            dead = EngineDeadError(f"the engine stopped ({why}): {error!r}")
            dead.__cause__ = error
            self._send(call, dead)
            _resolve(call.usage, NO_USAGE)  # no-op for any call already settled above
        if self._on_dead is not None:
            try:
                self._on_dead(error)
            except Exception:  # noqa: BLE001 - the engine is already dead; the callback must not hide why
                _logger.exception("on_dead callback failed")

    # ---- the feeding and delivering threads (an engine in a child process)

    def _feed(self) -> None:
        """Send the inbox to the child, in order, until shutdown; then ask the child to stop."""
        assert self._core is not None
        try:
            while not self._stopping:
                self._wake.wait(timeout=1.0)
                self._wake.clear()
                while self._inbox and not self._stopping:
                    message = self._inbox.popleft()
                    if isinstance(message, _Add):
                        self._send_add(message)
                    else:
                        self._core.send(message)  # an AbortRequest
        except (BrokenPipeError, OSError):  # the child is gone; the delivering thread reports it
            return
        self._core.close()

    def _send_add(self, add: _Add) -> None:
        call = add.call
        with self._lock:  # registered under the lock that _die takes: a call is settled by _die or delivered
            listening = self._error is None and self._calls.get(call.engine_id) is call
            if listening:
                self._in_engine[call.engine_id] = call
        if not listening:  # the consumer left (or the engine died) before the request got here
            _resolve(call.usage, NO_USAGE)
            return
        self._core.send(add.request)

    def _pump(self) -> None:
        """Deliver what the child sends until it stops; a child that dies, or exits unasked, kills the engine."""
        assert self._core is not None
        try:
            while True:
                message = self._core.recv()
                if isinstance(message, StepOutputs):
                    self._stats = message.stats
                    self._deliver(message.outputs)
                elif isinstance(message, AddRefused):
                    with self._lock:
                        call = self._in_engine.pop(message.engine_id, None)
                    if call is not None:
                        self._send(call, message.failure.exception())
                        _resolve(call.usage, NO_USAGE)
                elif isinstance(message, CoreDead):
                    self._die(RuntimeError(message.failure.message), "an error in the engine process")
                    return
        except (EOFError, OSError):
            if not self._stopping:
                self._die(
                    RuntimeError(f"the engine process exited (exit code {self._core.exitcode})"),
                    "the engine process exited",
                )
        except BaseException as error:  # noqa: BLE001 - every waiting stream must hear about a crash
            self._die(error, "an error while delivering outputs")
