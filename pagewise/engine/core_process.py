"""The engine core in a process of its own: ``LLMEngine`` stepped by a child process.

Why: the step loop runs Python between the kernels (scheduling, sampling, detokenizing), and in the serving
process that Python shares one GIL with the web stack, so a busy API slows every step. vLLM runs its engine core
in its own process for the same reason. ``AsyncLLMEngine(config, process=True)`` uses this module; what it
offers its callers does not change.

The wire is two one-way ``multiprocessing`` pipes carrying the typed messages below, pickled (``spawn`` start
method: no fork after torch's threads exist; the child runs the parent's own code, so both ends always agree on
the messages' shapes):

- parent → child: ``AddRequest``, ``AbortRequest``, ``Stop`` (``step_loop``: the loop's inputs in either form).
- child → parent: first exactly one of ``Ready`` or ``LoadFailed``; after ``Ready``, ``StepOutputs`` after every
  loop turn (aborts' final outputs and a step's outputs, with ``LLMEngine.stats()`` as of then), ``AddRefused``
  for an add the engine refused, and at most one ``CoreDead``, after which the child exits.

Invariants. Messages are handled in the order they were sent, between steps, so an abort is never handled
before its add. Outputs travel without their prompt (``prompt_token_ids`` empty, ``prompt`` None): the parent
holds both and puts them back. ``arrival_time`` is ``time.monotonic()``, one clock for every process of a host.
The child ignores SIGINT (a terminal's Ctrl-C reaches the whole process group; the parent decides when the
engine stops) and exits when its inbox reaches end of file, so it never outlives the parent.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import msgspec

from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import InvalidConfigError, InvalidRequestError, RequestFailedError
from pagewise.engine.limits import PromptLimits
from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.outputs import RequestOutput
from pagewise.engine.step_loop import AbortRequest, AddRequest, Stop, add_request, run_steps
from pagewise.engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from pagewise.engine.llm_engine import LLMEngine

_logger = logging.getLogger(__name__)
# How long the child's OpenMP threads (torch's libgomp) spin after a parallel region before they sleep, unless
# GOMP_SPINCOUNT is set: libgomp spins 300,000 times by default, so after every step the idle threads keep the
# cores busy for a while — the cores the serving process's event loop, database thread and Redis need right then
# to finish the step's requests. 10,000 cut the platform overhead per request with two workers by 1-2 ms and left
# the engine's throughput within noise (docs/benchmarks.md).
CHILD_ENVIRONMENT = {"GOMP_SPINCOUNT": "10000"}
_START_METHOD = "spawn"
_STOP_TIMEOUT_S = 30.0
_REAP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class CoreInfo:
    """What the parent needs from the loaded engine to validate and describe requests without the model."""

    model_name: str
    max_model_len: int
    num_blocks: int
    limits: PromptLimits
    arch: ModelArchConfig
    tokenizer: Tokenizer
    stats: dict[str, Any]


@dataclass(frozen=True, slots=True)
class Failure:
    """An exception as it crosses the pipe: its kind, message and parameter, never the object (not every
    exception pickles, and a traceback would hold the child's frames)."""

    kind: str  # "invalid_request" | "invalid_config" | "error"
    message: str
    param: str | None = None

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        if isinstance(error, InvalidRequestError):
            return cls("invalid_request", str(error), error.param)
        if isinstance(error, InvalidConfigError):
            return cls("invalid_config", str(error))
        if isinstance(error, RequestFailedError):
            return cls("error", str(error))
        return cls("error", f"{type(error).__name__}: {error}")

    def exception(self) -> Exception:
        """The exception to raise on the parent's side."""
        if self.kind == "invalid_request":
            return InvalidRequestError(self.message, param=self.param)
        if self.kind == "invalid_config":
            return InvalidConfigError(self.message)
        return RequestFailedError(self.message)


# ---- child → parent


class Ready(msgspec.Struct, frozen=True):
    info: CoreInfo


class LoadFailed(msgspec.Struct, frozen=True):
    failure: Failure


class StepOutputs(msgspec.Struct, frozen=True):
    """One loop turn's outputs, without their prompts (``prompt_token_ids`` empty, ``prompt`` None: the parent
    holds both), and the engine's stats as of then."""

    outputs: list[RequestOutput]
    stats: dict[str, Any]


class AddRefused(msgspec.Struct, frozen=True):
    engine_id: str
    failure: Failure


class CoreDead(msgspec.Struct, frozen=True):
    failure: Failure


ToChild = AddRequest | AbortRequest | Stop
FromChild = Ready | LoadFailed | StepOutputs | AddRefused | CoreDead


class EngineCoreProcess:
    """The parent's handle on the child: starts it and waits until the model is loaded (blocking; raises what
    the child failed with), then offers ``send`` (one thread at a time) and ``recv`` (one thread at a time)."""

    def __init__(self, config: EngineConfig, *, progress: bool) -> None:
        context = multiprocessing.get_context(_START_METHOD)
        child_inbox, self._outbox = context.Pipe(duplex=False)  # (reading end, writing end)
        self._inbox, child_outbox = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_core,
            args=(config, progress, child_inbox, child_outbox),
            name="pagewise-engine-core",
            daemon=True,
        )
        with _child_environment():
            self._process.start()
        child_inbox.close()
        child_outbox.close()
        try:
            first = self._inbox.recv()
        except EOFError:
            self._process.join(_STOP_TIMEOUT_S)
            raise RuntimeError(
                f"the engine process exited while loading (exit code {self._process.exitcode})"
            ) from None
        if isinstance(first, LoadFailed):
            self._process.join(_STOP_TIMEOUT_S)
            raise first.failure.exception()
        self.info: CoreInfo = first.info

    @property
    def exitcode(self) -> int | None:
        """The child's exit status (negative: the signal that killed it), waiting up to a few seconds for a child
        whose pipe has closed to be reaped; None if it is still running."""
        self._process.join(_REAP_TIMEOUT_S)
        return self._process.exitcode

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def send(self, message: ToChild) -> None:
        self._outbox.send(message)

    def recv(self) -> FromChild:
        """The child's next message; ``EOFError`` once it exited and every message was read."""
        return self._inbox.recv()

    def close(self) -> None:
        """Ask the child to stop, wait for it (killing it if it does not stop in time) and close the pipes."""
        with contextlib.suppress(OSError):  # already gone (BrokenPipeError), or the pipe already closed
            self._outbox.send(Stop())
        self._process.join(_STOP_TIMEOUT_S)
        if self._process.is_alive():
            _logger.warning("the engine process did not stop within %.0f s; killing it", _STOP_TIMEOUT_S)
            self._process.kill()
            self._process.join()
        self._outbox.close()
        self._inbox.close()


# ---- the child


def run_core(config: EngineConfig, progress: bool, inbox: Connection, outbox: Connection) -> None:
    """The child's main: load the engine, report ``ready`` (or ``failed``), then step until told to stop.

    Ctrl-C and SIGTERM sent to the whole process group (a terminal, ``kill -- -PGID``, a supervisor stopping a
    service) are the parent's to act on: it finishes or hands over its requests, then stops this child. Dying on
    them here would fail those requests first. A parent that is gone shows as a closed pipe, and the child ends.
    """
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    from pagewise.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(config, progress=progress)
    except BaseException as error:  # noqa: BLE001 - the parent raises it
        outbox.send(LoadFailed(Failure.of(error)))
        return
    info = CoreInfo(
        engine.model_name,
        engine.max_model_len,
        engine.num_blocks,
        engine.limits,
        engine.arch,
        engine.tokenizer,
        engine.stats(),
    )
    outbox.send(Ready(info))
    try:
        failure = run_steps(engine, partial(_take, engine, inbox, outbox), partial(_publish, engine, outbox))
    except (EOFError, BrokenPipeError):  # the parent is gone: nobody to serve
        return
    except BaseException as error:  # noqa: BLE001 - the parent fails every stream with it
        failure = error
    if failure is not None:
        _logger.critical("the engine core stopped", exc_info=failure)
        outbox.send(CoreDead(Failure.of(failure)))


def _take(engine: LLMEngine, inbox: Connection, outbox: Connection, idle: bool, outputs: list) -> bool:
    """`run_steps`' messages: the parent's, blocking for the first one when the engine is idle."""
    if idle and not _handle(engine, inbox.recv(), outputs, outbox):
        return False
    while inbox.poll():
        if not _handle(engine, inbox.recv(), outputs, outbox):
            return False
    return True


def _publish(engine: LLMEngine, outbox: Connection, outputs: list[RequestOutput]) -> None:
    for output in outputs:
        output.prompt_token_ids, output.prompt = [], None
    outbox.send(StepOutputs(outputs, engine.stats()))


def _handle(engine: LLMEngine, message: ToChild, outputs: list, outbox: Connection) -> bool:
    """Apply one parent message; False for ``Stop``."""
    if isinstance(message, Stop):
        return False
    if isinstance(message, AbortRequest):
        final = engine.abort_request(message.engine_id)
        if final is not None:
            outputs.append(final)
        return True
    if (error := add_request(engine, message)) is not None:
        outbox.send(AddRefused(message.engine_id, Failure.of(error)))
    return True


@contextlib.contextmanager
def _child_environment() -> Iterator[None]:
    """`CHILD_ENVIRONMENT` (each variable only where the environment does not set it) for a child started inside;
    the parent's environment is as before afterwards."""
    added = {name: value for name, value in CHILD_ENVIRONMENT.items() if name not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
