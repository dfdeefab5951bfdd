"""The engine's step loop: one loop for both forms of ``AsyncLLMEngine`` — the background thread that steps an
engine of this process, and the child process of ``core_process``. They differ only in where messages come from
and where outputs go, which they pass in.

Invariants:
- Messages (adds, aborts) are applied in the order they were sent: between steps, and between two parts of a step
  (the engine's ``poll``, so that an arrival owed service can interrupt the step; the engine defers an abort of a
  request in the step to the step's end). A stop that arrives during a step ends the loop after it.
- One turn: apply what arrived (waiting for it only when the engine has nothing to do), publish the final outputs
  that produced (aborts), step once if there is work, publish the step's outputs (with the stats as of then).
- A failed step (``StepFailedError``) fails the requests it touched, and its outputs are published like any
  step's; ``MAX_FAILED_STEPS`` failed steps in a row end the loop with the last failure (the engine is then
  dead). Any other exception propagates: the caller treats it as the engine's death.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from pagewise.engine.errors import InvalidRequestError, RequestFailedError, StepFailedError
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.outputs import RequestOutput
from pagewise.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagewise.engine.llm_engine import LLMEngine

_logger = logging.getLogger(__name__)
MAX_FAILED_STEPS = 3


class AddRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Start a request (``LLMEngine.add_request`` with delta outputs); ``arrival_time`` is ``time.monotonic()``."""

    engine_id: str
    token_ids: list[int]
    params: SamplingParams
    tenant_id: str | None
    tenant_weight: float
    arrival_time: float
    prompt_text: str | None
    priority: int = 0
    lora_request: LoRARequest | None = None


class AbortRequest(msgspec.Struct, frozen=True):
    engine_id: str


class Stop(msgspec.Struct, frozen=True):
    """End the loop (the child form; the thread form stops on its owner's flag)."""

# Apply the messages that arrived, adding the outputs they produce (aborts' final outputs) to the list; `idle`:
# the engine has nothing to run, so wait for a message (a bounded wait is fine). False: stop the loop.
TakeMessages = Callable[[bool, list[RequestOutput]], bool]
Publish = Callable[[list[RequestOutput]], None]


def run_steps(engine: LLMEngine, take: TakeMessages, publish: Publish) -> StepFailedError | None:
    """Turn until `take` says stop (returns None) or ``MAX_FAILED_STEPS`` steps in a row failed (returns the last
    failure). The structured-output vocabulary is built in the background from the start."""
    failed_steps = 0
    stopping = False
    engine.grammar.prepare()  # a served engine's first constrained request must not stall every stream

    def poll() -> None:
        nonlocal stopping
        arrived: list[RequestOutput] = []
        stopping = stopping or not take(False, arrived)
        if arrived:
            publish(arrived)

    while True:
        outputs: list[RequestOutput] = []
        if stopping or not take(not engine.has_unfinished_requests(), outputs):
            return None
        if outputs:  # aborts' final outputs go out now, not a step later
            publish(outputs)
            outputs = []
        failure = None
        if engine.has_unfinished_requests():
            try:
                outputs.extend(engine.step(None if stopping else poll))
            except StepFailedError as error:
                failure = error
                outputs.extend(error.outputs)
            failed_steps = failed_steps + 1 if failure else 0
        publish(outputs)
        if failure is not None and failed_steps >= MAX_FAILED_STEPS:
            return failure


def add_request(engine: LLMEngine, add: AddRequest) -> Exception | None:
    """Apply `add`; what it failed with, if it did: ``InvalidRequestError`` as is, anything else (logged) as a
    ``RequestFailedError`` caused by it. One request's failure is its own: the loop goes on."""
    try:
        engine.add_request(
            add.engine_id,
            add.token_ids,
            add.params,
            add.tenant_id,
            delta=True,
            prompt_text=add.prompt_text,
            tenant_weight=add.tenant_weight,
            arrival_time=add.arrival_time,
            priority=add.priority,
            lora_request=add.lora_request,
        )
    except InvalidRequestError as error:
        return error
    except Exception as error:  # noqa: BLE001 - contained to this request
        _logger.warning("request %r could not be added", add.engine_id, exc_info=error)
        failure = RequestFailedError(f"the request could not be added: {type(error).__name__}: {error}")
        failure.__cause__ = error
        return failure
    return None
