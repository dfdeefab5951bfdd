"""Per-request milestones and lifecycle events, and the engine's latency histograms: plain counts, no Prometheus
(``pagewise.platform.telemetry`` reads ``snapshots()`` at scrape time).

``LLMEngine`` calls ``EngineMetrics`` on its one thread, at three points of a step:

- ``stepped(step, owner, started, ended)`` after the forward pass, before the step's computed tokens are applied
  (``started``: before scheduling; ``ended``: after sampling). It records the step's preemptions, each request's
  first admission (``Scheduled``), each resumption after a preemption (``Resumed``) and each prefill chunk
  (``PrefillChunk``: a scheduled share starting before the sample's ``prefill_end``), and observes the step's
  batch size in ``iteration_tokens_total``. An empty step (it may still have preempted) is recorded too.
- ``token(group, request)`` for each token sampled in that step.
- ``finished(group)`` when a request's last sample stopped (stop or length) in that step.

vLLM's definitions, on ``time.monotonic()``: arrival is ``add_request`` (or the caller's ``arrival_time``: the
``generate`` call of ``AsyncLLMEngine``); queue time = first scheduled - arrival; prefill time = first token -
first scheduled; decode time = finished - first token; end-to-end = finished - arrival; time to first token =
first token - arrival; inter-token latency = the gap between two consecutive tokens of one sample (so a gap
spent preempted counts). A step's events carry its start time, a token the step's end time.

Invariants: every histogram only grows. Time to first token counts each request that got a token, once; the
inter-token latency each token after a sample's first; the four request histograms each request that finished in
the engine (aborted and failed ones are not counted); ``iteration_tokens_total`` each non-empty step.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pagewise.engine.outputs import Preempted, PrefillChunk, Resumed, Scheduled
from pagewise.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagewise.engine.request_group import RequestGroup
    from pagewise.engine.scheduler import SchedulerOutput

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
    160.0, 640.0, 2560.0
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0,
    1920.0, 7680.0
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(frozen=True, slots=True)
class HistogramSnapshot:
    """A histogram at one moment: ``counts[i]`` observations in bucket ``i`` (upper bound ``bounds[i]``
    inclusive, the last bucket unbounded), so ``len(counts) == len(bounds) + 1``; ``sum`` of the observations."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(self.bounds, tuple(self.counts), self.sum)


class EngineMetrics:
    def __init__(self) -> None:
        self._ttft, self._itl = Histogram(TTFT_BUCKETS), Histogram(ITL_BUCKETS)
        self._e2e, self._queue = Histogram(REQUEST_LATENCY_BUCKETS), Histogram(REQUEST_LATENCY_BUCKETS)
        self._prefill, self._decode = Histogram(REQUEST_LATENCY_BUCKETS), Histogram(REQUEST_LATENCY_BUCKETS)
        self._iteration = Histogram(ITERATION_TOKENS_BUCKETS)
        self.histograms = {  # by their names under `pagewise:` (vLLM's, with `vllm:`)
            "time_to_first_token_seconds": self._ttft,
            "inter_token_latency_seconds": self._itl,
            "e2e_request_latency_seconds": self._e2e,
            "request_queue_time_seconds": self._queue,
            "request_prefill_time_seconds": self._prefill,
            "request_decode_time_seconds": self._decode,
            "iteration_tokens_total": self._iteration,
        }
        self.num_steps = 0
        self._now = 0.0  # the latest step's end: the time of its tokens and finishes

    def snapshots(self) -> dict[str, HistogramSnapshot]:
        return {name: histogram.snapshot() for name, histogram in self.histograms.items()}

    def stepped(
        self, step: SchedulerOutput, owner: Mapping[Request, RequestGroup], started: float, ended: float
    ) -> None:
        self.num_steps += 1
        self._now = ended
        number = self.num_steps
        if step.scheduled:
            self._iteration.observe(step.num_batched_tokens)
        for request in step.preempted:
            group = owner.get(request)
            if group is None:
                continue
            mode = "swap" if request.status is RequestStatus.SWAPPED else "recompute"
            request.preempted_mode = mode
            group.metrics = replace(group.metrics, num_preemptions=group.metrics.num_preemptions + 1)
            group.events.append(Preempted(started, number, request.sample_index, mode))
        for request, num_new in step.scheduled.items():
            group = owner.get(request)
            if group is None:
                continue
            start = request.num_computed_tokens  # not yet advanced by this step: the prefix-cache hit if admitted now
            if group.metrics.first_scheduled_time is None:
                group.metrics = replace(group.metrics, first_scheduled_time=started)
                group.events.append(Scheduled(started, number, start, len(request.block_ids)))
                request.prefill_end, request.preempted_mode = request.num_tokens, None
            elif request.preempted_mode is not None:
                mode, request.preempted_mode = request.preempted_mode, None
                cached = 0
                if mode == "recompute":
                    request.prefill_end, cached = request.num_tokens, start
                sample = request.sample_index
                group.events.append(Resumed(started, number, sample, mode, cached, len(request.block_ids)))
            if num_new and start < request.prefill_end:
                recompute = request.num_output_tokens > 0
                group.events.append(PrefillChunk(started, ended, number, request.sample_index, num_new, recompute))

    def token(self, group: RequestGroup, request: Request) -> None:
        """A token of ``request`` was sampled in the latest step."""
        now = self._now
        if request.last_token_time is not None:
            self._itl.observe(now - request.last_token_time)
        elif group.metrics.first_token_time is None:
            group.metrics = replace(group.metrics, first_token_time=now)
            self._ttft.observe(now - group.metrics.arrival_time)
        request.last_token_time = now

    def finished(self, group: RequestGroup) -> None:
        """``group``'s last sample stopped in the latest step."""
        now = self._now
        metrics = group.metrics = replace(group.metrics, finished_time=now)
        first_scheduled, first_token = metrics.first_scheduled_time, metrics.first_token_time
        assert first_scheduled is not None and first_token is not None  # a stopped sample was scheduled and sampled
        self._e2e.observe(now - metrics.arrival_time)
        self._queue.observe(first_scheduled - metrics.arrival_time)
        self._prefill.observe(first_token - first_scheduled)
        self._decode.observe(now - first_token)
