"""What a caller sees of one request: its samples' text and stop decisions, its deltas, and its usage.

The engine appends each sampled token to its ``Request`` and then asks the ``SampleState`` whether the sample
stops; freeing blocks stays the engine's job. Stop semantics are vLLM's: a stop token (EOS unless ignored, or
one of ``stop_token_ids``) keeps its id in ``token_ids`` but adds no text unless ``include_stop_str_in_output``;
a stop string ends the text before itself (after itself with ``include_stop_str_in_output``) and is looked for
only once ``min_tokens`` tokens were generated.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

from pagewise.engine.errors import RequestFailedError
from pagewise.engine.outputs import CompletionOutput, RequestEvent, RequestMetrics, RequestOutput, RequestUsage
from pagewise.engine.request import Request
from pagewise.engine.tokenizer import IncrementalDetokenizer

Finish = tuple[str, str | int | None]  # (finish_reason, stop_reason)


@dataclass(slots=True, eq=False)
class SampleState:
    """One sample's output state: text so far (cut at a stop string) and what a delta consumer has seen."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False

    def after_token(self, token: int, eos_token_ids: Collection[int], max_model_len: int) -> Finish | None:
        """Take in ``token`` (already appended to the request): extend the text and say whether the sample stops."""
        request = self.request
        params = request.params
        by_eos = not params.ignore_eos and token in eos_token_ids
        stop_token = by_eos or token in (params.stop_token_ids or ())
        previous_len = len(self.text)
        if not stop_token or params.include_stop_str_in_output:
            self.text += self.detokenizer.push(token)
        if stop_token:
            self.text += self.detokenizer.flush()
            return "stop", None if by_eos else token
        stop = self._stop_string(previous_len)
        if stop is not None:
            return "stop", stop
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= max_model_len:
            self.text += self.detokenizer.flush()
            return "length", None
        return None

    def grammar_complete(self) -> Finish:
        """The sample's structured output is a whole document and its grammar allows nothing more: it stops."""
        self.text += self.detokenizer.flush()
        return "stop", None

    def _stop_string(self, previous_len: int) -> str | None:
        """The earliest stop string ending in the new text; the text is cut there (the detokenizer's held-back
        text is dropped with the rest)."""
        request = self.request
        params = request.params
        strings = params.stop_strings
        if not strings or request.num_output_tokens <= params.min_tokens:
            return None
        start = max(0, previous_len - max(len(s) for s in strings) + 1)
        found = [(self.text.find(s, start), s) for s in strings]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return None
        pos, stop = min(found)
        self.text = self.text[: pos + len(stop) if params.include_stop_str_in_output else pos]
        return stop


@dataclass(slots=True, eq=False)
class RequestGroup:
    """One request as its caller sees it: ``n`` samples sharing a prompt, and what they cost.

    ``num_prompt_reached`` is the high-water mark of computed prompt positions (prefix hits included), so a
    recompute after preemption is never charged twice; ``num_prompt_cached`` counts the positions among them
    that a prefix hit served when they were first reached. ``hold_back`` characters of an unfinished sample's
    text stay unreported, as they may still turn out to start a stop string. ``metrics`` and ``events`` are kept
    by the engine's ``EngineMetrics``; a delta output hands the events over (the group keeps none it reported).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[SampleState]
    delta: bool
    hold_back: int = 0
    changed: bool = field(default=False)
    num_prompt_reached: int = 0
    num_prompt_cached: int = 0
    num_generated: int = 0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))
    events: list[RequestEvent] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(s.request.finished for s in self.samples)

    @property
    def usage(self) -> RequestUsage:
        return RequestUsage(
            prompt_tokens=self.num_prompt_reached,
            cached_tokens=self.num_prompt_cached,
            completion_tokens=self.num_generated,
        )

    def sample_of(self, request: Request) -> SampleState:
        return next(s for s in self.samples if s.request is request)

    def record_prompt_progress(self, start: int, end: int) -> None:
        """A sample computed positions ``[start, end)`` this step, after a prefix hit if ``start`` lies beyond
        the high-water mark (only a hit makes computed tokens jump)."""
        num_prompt = len(self.prompt_token_ids)
        start, end = min(start, num_prompt), min(end, num_prompt)
        if start > self.num_prompt_reached:
            self.num_prompt_cached += start - self.num_prompt_reached
        self.num_prompt_reached = max(self.num_prompt_reached, end)

    def output(self, error: RequestFailedError | None = None) -> RequestOutput:
        """The output to report now: everything so far, or (``delta``) only what is new since the last report."""
        completions = []
        for index, sample in enumerate(self.samples):
            request = sample.request
            visible = len(sample.text) if request.finished else max(0, len(sample.text) - self.hold_back)
            if self.delta:
                if sample.finish_sent:
                    continue
                begin_tok, begin_chr = sample.num_sent_tokens, sample.num_sent_chars
                if begin_tok == request.num_output_tokens and not request.finished:
                    continue
            else:
                begin_tok = begin_chr = 0
            logprobs = request.output_logprobs[begin_tok:] if request.params.logprobs is not None else None
            completions.append(
                CompletionOutput(
                    index=index,
                    text=sample.text[begin_chr:visible],
                    token_ids=request.output_token_ids[begin_tok:],
                    finish_reason=request.finish_reason,
                    logprobs=logprobs,
                    stop_reason=request.stop_reason,
                )
            )
            sample.num_sent_tokens = request.num_output_tokens
            sample.num_sent_chars = max(visible, begin_chr)
            sample.finish_sent = request.finished
        events = self.events
        if self.delta:
            self.events = []
        else:
            events = list(events)
        return RequestOutput(
            self.request_id,
            self.prompt_token_ids,
            completions,
            self.finished,
            self.samples[0].request.num_cached_tokens,
            self.prompt,
            self.usage,
            error,
            self.metrics,
            events,
        )
