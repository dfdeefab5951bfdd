"""One `Submit` run on an engine, from its first step to its final row: the engine side of the protocol.

Invariants:
- An execution ends with exactly one terminal event — `Finished` (completed / cancelled / failed) or `Rejected`
  — emitted only after the request's final row is written, so a client that saw the end reads a final row. Every
  delta is emitted before that write: a worker killed between the write and the end leaves a redelivery only the
  row's `Finished` to re-send, and the client already has every token.
- It ends through `Settlement.settle` (`settlement.py`): the guarded final write, the reconcile by the write that
  won, then the terminal event. A redelivered Submit whose row is already final is not run again: its `Finished`
  is re-sent from the row (`Settlement.replay`), and nothing is billed twice.
- Billed tokens are what the engine really computed: each prompt's usage report (`RequestUsage`), resolved when
  the prompt leaves the engine for any reason — an abort included, so tokens generated before the engine saw the
  abort are billed too.
- `abort()` works at any moment: before the first step (nothing runs, nothing is billed), while running (the
  engine frees the request's blocks at its next step; the execution ends `cancelled`), or after the end (no-op).
- An execution whose transport says it no longer holds its Submit (`hold`: another worker took it over after
  this one was presumed dead) stops without a word: before each delta and before the final write it asks, and
  when the answer is no it frees its engine work and raises `Superseded` — no event, no row, no reconcile; the
  attempt that took over owns the request.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagewise.engine.errors import EngineDeadError, InvalidRequestError
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.outputs import CompletionOutput, Logprob, RequestOutput
from pagewise.engine.request_ids import prompt_id
from pagewise.serving.adapter_store import AdapterStore
from pagewise.serving.ledgers import FinishedRequest
from pagewise.serving.protocol import (
    ChoiceDelta,
    ChoiceSoFar,
    Delta,
    ErrorCode,
    ErrorInfo,
    Event,
    PositionLogprobs,
    RequestStatus,
    Submit,
    TokenLogprob,
    Usage,
)
from pagewise.serving.request_trace import RequestTrace
from pagewise.serving.settlement import Settlement, Superseded

if TYPE_CHECKING:
    from pagewise.engine.async_engine import AsyncLLMEngine

logger = logging.getLogger(__name__)
ABORTED = "abort"  # the engine's finish_reason for a request aborted on its side
USAGE_REPORT_TIMEOUT_S = 30.0  # how long the final write waits for the engine's usage reports


@dataclass(slots=True)
class _Prompt:
    report: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    prompt_tokens: int = 0
    cached_tokens: int = 0
    started: bool = False  # its engine stream began: its report will be resolved, whatever happens next
    reached_engine: bool = False


class Execution:
    """Runs `submit` on `engine` (attempt number `attempt`); its events go out, and it ends, through `settlement`
    (whose `emit` is required here)."""

    def __init__(
        self,
        submit: Submit,
        engine: AsyncLLMEngine,
        settlement: Settlement,
        *,
        attempt: int = 1,
        adapters: AdapterStore | None = None,
    ) -> None:
        assert settlement.emit is not None, "an execution's events have readers"
        self.submit = submit
        self._adapters = adapters
        self._lora_request: LoRARequest | None = None
        self.attempt = attempt
        self._engine, self._settlement, self._emit = engine, settlement, settlement.emit
        n = submit.params.n
        self._choices = [ChoiceSoFar(i, logprobs=None) for i in range(len(submit.prompts) * n)]
        self._prompts = [_Prompt() for _ in submit.prompts]
        self._aborted = False
        self.won = False  # whether this execution's final write was the one that finished the row
        self._started_at = time.time()
        self._first_token_at: float | None = None
        self._num_generated = 0
        self._background: set[asyncio.Task[None]] = set()
        self._trace = RequestTrace(submit, attempt)

    @property
    def request_id(self) -> str:
        return self.submit.request_id

    def engine_ids(self) -> list[str]:
        return [prompt_id(self.request_id, i) for i in range(len(self.submit.prompts))]

    def abort(self) -> None:
        """End the request as `cancelled`, now or at its next step; idempotent."""
        self._aborted = True
        self._stop_engine()

    def _stop_engine(self) -> None:
        for engine_id in self.engine_ids():
            self._engine.abort(engine_id)

    async def _check_held(self) -> None:
        """Raise `Superseded` (the engine's work freed) when another worker has taken the Submit over."""
        try:
            await self._settlement.check_held(self.submit)
        except Superseded:
            self._stop_engine()
            raise

    async def run(self) -> Event:
        """Run to the end (or the abort); returns the terminal event, already emitted."""
        with self._trace.execution():
            event = await self._run()
            self._trace.ended(event, [c.finish_reason for c in self._choices if c.finish_reason])
            return event

    async def _run(self) -> Event:
        if self.attempt > 1:  # a redelivery: some attempt may have finished the request already
            final = await self._settlement.requests.final_state(self.request_id)
            if final is not None:
                return await self._settlement.replay(self.submit, final, attempt=self.attempt)
        try:
            self._check()
        except InvalidRequestError as exc:
            return await self._reject(ErrorInfo(ErrorCode.INVALID_REQUEST, str(exc), exc.param))
        if self.submit.deadline is not None and time.time() > self.submit.deadline:
            message = "the request waited past its deadline before an engine could take it"
            return await self._reject(ErrorInfo(ErrorCode.QUEUE_TIMEOUT, message))
        status, error = RequestStatus.CANCELLED, None
        try:
            if not self._aborted:
                async with aclosing(_merge([self._stream(i) for i in range(len(self._prompts))])) as outputs:
                    async for prompt_index, output in outputs:
                        await self._record(prompt_index, output)
                        if self._aborted:
                            break
                if not self._aborted and not any(c.finish_reason == ABORTED for c in self._choices):
                    status = RequestStatus.COMPLETED
        except Superseded:
            raise
        except EngineDeadError:
            logger.exception("request %s failed: the engine stopped", self.request_id)
            status = RequestStatus.FAILED
            error = ErrorInfo(ErrorCode.ENGINE_UNAVAILABLE, "the inference engine stopped")
        except Exception:  # noqa: BLE001 - one request's failure is reported, never raised into the host
            # the exception's text stays in the log (and the trace): a tenant reads the row's error
            logger.exception("request %s failed on the engine", self.request_id)
            status = RequestStatus.FAILED
            error = ErrorInfo(ErrorCode.INTERNAL, "the engine failed while running this request")
        # Cancellation (the host's loop going down) skips this: the row's lease then expires, and the request
        # is failed as an orphan or, in distributed mode, redelivered to another worker.
        return await asyncio.shield(asyncio.ensure_future(self._settle(status, error)))

    def _check(self) -> None:
        """The engine's own checks (the API ran the same against the published limits), and where the request's
        adapter is (its files are read and verified when the engine takes the request)."""
        for prompt in self.submit.prompts:
            self._engine.process_prompt(prompt, self.submit.params)
        if self.submit.adapter is not None:
            if self._adapters is None or not self._engine.config.enable_lora:
                raise InvalidRequestError("this engine serves no adapters", param="model")
            self._lora_request = self._adapters.lora_request(self.submit.adapter)

    async def _stream(self, index: int) -> AsyncIterator[RequestOutput]:
        """Prompt `index`'s outputs. `started` is set with no suspension point before the engine's `generate`
        runs, which resolves the prompt's usage report however it ends from then on."""
        state = self._prompts[index]
        state.started = True
        stream = self._engine.generate(
            self.submit.prompts[index],
            self.submit.params,
            self.engine_ids()[index],
            self.submit.tenant_id,  # the prefix-cache salt: it comes from the API key, never from the body
            usage=state.report,
            tenant_weight=self.submit.tenant_weight,
            priority=self.submit.priority,
            lora_request=self._lora_request,
        )
        async with aclosing(stream) as outputs:
            async for output in outputs:
                yield output

    async def _record(self, prompt_index: int, output: RequestOutput) -> None:
        prompt = self._prompts[prompt_index]
        prompt.reached_engine = True
        prompt.prompt_tokens, prompt.cached_tokens = len(output.prompt_token_ids), output.num_cached_tokens
        n = self.submit.params.n
        choices = []
        for c in output.outputs:
            if not (c.token_ids or c.text or c.finish_reason):
                continue
            choice = _choice(prompt_index * n + c.index, c, self.submit.params.logprobs)
            self._choices[choice.index].add(choice)
            self._num_generated += len(c.token_ids)
            choices.append(choice)
        self._trace.engine_output(prompt_index, output, self._num_generated)
        if not choices:
            return
        engine_ttft_s = None
        if self._first_token_at is None and any(c.token_ids for c in choices):
            self._first_token_at = time.time()
            engine_ttft_s = self._first_token_at - self._started_at
            if not output.finished:  # a request done at its first token goes straight to its final write
                started, first = _utc(self._started_at), _utc(self._first_token_at)
                self._spawn(self._settlement.requests.mark_running(self.request_id, started, first))
        reached = [p for p in self._prompts if p.reached_engine]
        await self._check_held()
        await self._emit(
            Delta(
                attempt=self.attempt,
                choices=choices,
                prompt_tokens=sum(p.prompt_tokens for p in reached),
                cached_tokens=sum(p.cached_tokens for p in reached),
                engine_ttft_s=engine_ttft_s,
            )
        )

    async def _reject(self, error: ErrorInfo) -> Event:
        """Refused before running: the row fails with the reason, the reservation comes back whole."""
        return await self._end(self._result(RequestStatus.FAILED, error, Usage()), refused=True)

    async def _settle(self, status: RequestStatus, error: ErrorInfo | None) -> Event:
        return await self._end(self._result(status, error, await self._usage()))

    async def _end(self, result: FinishedRequest, *, refused: bool = False) -> Event:
        # the first-token write lands before the final one (a guarded write on `queued`: never after it anyway)
        await asyncio.gather(*self._background, return_exceptions=True)
        settled = await self._settlement.settle(self.submit, result, attempt=self.attempt, refused=refused)
        self.won = settled.won
        return settled.event

    async def _usage(self) -> Usage:
        """The engine's own count, summed over the prompts that reached it; the streamed counts if it hung."""
        reports = [p.report for p in self._prompts if p.started]
        if not reports:
            return Usage()
        try:
            if all(r.done() for r in reports):  # the usual case: reported along with the last output
                usages = [r.result() for r in reports]
            else:
                usages = await asyncio.wait_for(
                    asyncio.gather(*(asyncio.wrap_future(r) for r in reports)), USAGE_REPORT_TIMEOUT_S
                )
        except Exception:  # noqa: BLE001 - a dead or hung engine: bill what its deltas reported
            logger.exception("request %s: no usage report; billing the streamed counts", self.request_id)
            reached = [p for p in self._prompts if p.reached_engine]
            return Usage(
                prompt_tokens=sum(p.prompt_tokens for p in reached),
                completion_tokens=sum(c.num_tokens for c in self._choices),
                cached_tokens=sum(p.cached_tokens for p in reached),
            )
        return Usage(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            cached_tokens=sum(u.cached_tokens for u in usages),
        )

    def _result(self, status: RequestStatus, error: ErrorInfo | None, usage: Usage) -> FinishedRequest:
        return FinishedRequest(
            status=status,
            output=[
                {"index": c.index, "text": c.full_text, "finish_reason": c.finish_reason} for c in self._choices
            ],
            finish_reason=self._choices[0].finish_reason,
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
            error=error,
            started_at=_utc(self._started_at),
            first_token_at=None if self._first_token_at is None else _utc(self._first_token_at),
            finished_at=dt.datetime.now(dt.UTC),
        )

    def _spawn(self, coroutine: Awaitable[None]) -> None:
        """Run a best-effort side write (the first-token time); its failure is a warning, never the request's."""
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background_done)

    def _background_done(self, task: asyncio.Future[None]) -> None:
        self._background.discard(task)
        if not task.cancelled() and (error := task.exception()) is not None:
            logger.warning("request %s: a side write failed (%s)", self.request_id, error)


def _utc(seconds: float) -> dt.datetime:
    return dt.datetime.fromtimestamp(seconds, dt.UTC)


def _choice(index: int, c: CompletionOutput, num_logprobs: int | None) -> ChoiceDelta:
    logprobs = None
    if num_logprobs is not None and c.logprobs is not None:
        logprobs = [_position(tid, pos, num_logprobs) for tid, pos in zip(c.token_ids, c.logprobs, strict=True)]
    return ChoiceDelta(index, c.text, list(c.token_ids), c.finish_reason, logprobs)


def _position(token_id: int, candidates: dict[int, Logprob], k: int) -> PositionLogprobs:
    def entry(tid: int, lp: Logprob) -> TokenLogprob:
        return TokenLogprob(tid, lp.decoded_token or "", lp.logprob)

    ranked = sorted(candidates.items(), key=lambda item: item[1].rank)
    top = [entry(tid, lp) for tid, lp in ranked[:k]]
    return PositionLogprobs(chosen=entry(token_id, candidates[token_id]), top=top)


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several prompts' streams as their outputs arrive; leaving early closes them all."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as stream:
            async for output in stream:
                yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream) as outputs:
                async for output in outputs:
                    queue.put_nowait((index, output))
            queue.put_nowait((index, None))
        except Exception as exc:
            queue.put_nowait((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                remaining -= 1
                continue
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
