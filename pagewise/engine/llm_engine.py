"""``LLMEngine``: requests in, one scheduled step at a time, ``RequestOutput``s out.

Failures are contained. Per-request work of a step (sampling a row, recording computed tokens, appending a token,
detokenizing, stop checks) that raises fails that request alone: it finishes with ``finish_reason="error"``, its
blocks are freed and its final output carries a ``RequestFailedError``. Batch-wide work that raises (scheduling,
the forward pass) fails every request the step touched and ``step`` raises ``StepFailedError``; block accounting
is verified afterwards, and if it does not add up ``check_accounting``'s ``RuntimeError`` escapes, chained to the
original error (the engine cannot be trusted).

Interruptible steps. Given a ``poll`` (which applies the messages that arrived), ``step`` checks between two parts
whether a request arrived that is owed service ahead of the step (``Scheduler.schedule_interrupt``); if one is,
the step is set aside (the one step ``in flight``, with its forward pass state), a short interrupting step runs
whole and ``step`` returns its outputs; the next ``step`` resumes the paused one where it stopped. Invariants:
at most one step is paused; nothing the paused step holds is preempted, swapped or freed until it completes — an
abort of one of its requests waits for its end (``abort_request`` defers it); its requests' outputs are exactly
what they would have been, as the interrupting step writes none of its KV slots and reads none it writes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pagewise.engine.adapter_slots import AdapterSlots
from pagewise.engine.block_pool import BlockPool, extent_blocks
from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import (
    InvalidConfigError,
    InvalidRequestError,
    RequestFailedError,
    StepFailedError,
)
from pagewise.engine.gemm_selection import select_gemm_path
from pagewise.engine.grammar_matcher import GrammarTokenizer, advance
from pagewise.engine.host_memory import keep_freed_memory
from pagewise.engine.kv_budget import DeviceMemory, cuda_kv_cache_bytes, peak_activation_bytes
from pagewise.engine.kv_cache_manager import KVCacheManager
from pagewise.engine.limits import PromptLimits, check_priority, prompt_token_ids
from pagewise.engine.loader import cache_root, load_model
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.model_runner import KVCache, ModelRunner, StepRun, profile_forward
from pagewise.engine.models.llama import LlamaForCausalLM, skip_weight_init
from pagewise.engine.outputs import RequestMetrics, RequestOutput, RequestUsage
from pagewise.engine.request import Request, RequestStatus
from pagewise.engine.request_group import RequestGroup, SampleState
from pagewise.engine.request_ids import sample_id
from pagewise.engine.request_metrics import EngineMetrics
from pagewise.engine.sampler import Sampler, SampleResult
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.scheduler import Scheduler, SchedulerOutput
from pagewise.engine.tokenizer import IncrementalDetokenizer

PromptInput = str | Sequence[int]

_logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _InFlight:
    """The step being run: its schedule, its forward pass so far, when it started, how often it was interrupted,
    and how many requests had been added when it last looked for one owed an interrupt."""

    step: SchedulerOutput
    run: StepRun
    started: float
    checked_at_add: int
    interrupts: int = 0


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every live request. Not thread-safe: one thread drives
    it (``AsyncLLMEngine`` wraps it for asyncio). A rejected ``add_request`` leaves no trace."""

    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory()
        budget = config.resolve_kv_cache_bytes()
        at_start = DeviceMemory.read(self.device) if budget is None else None
        self.precision = precision = config.resolve_precision()
        loaded = load_model(config.model, dtype=precision.model, cache_dir=config.cache_dir, progress=progress)
        self.model_name = config.served_names(loaded.name)[0]
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.generation_eos_token_ids)
        arch = loaded.arch
        self.arch = arch
        self.max_model_len = config.resolve_max_model_len(arch.max_position_embeddings)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.max_model_len)
        fair_budget = config.resolve_fair_max_num_batched_tokens(self.max_num_batched_tokens, self.max_model_len)
        self.block_size = config.block_size
        with skip_weight_init():
            model = LlamaForCausalLM(arch, self.max_model_len).to(precision.model)
        model.load_hf_weights(loaded.weights)
        del loaded
        self.model = model.to(self.device).eval()
        self.gemm = select_gemm_path(
            config.gemm_path, arch, self.device, precision.matmul, cache_root(config.cache_dir)
        )
        self.model.use_gemm_plan(self.gemm.plan, precision.matmul)
        _logger.info(
            "matmul path %s (%s): %s; few-rows product up to %d rows",
            self.gemm.plan.describe(),
            self.gemm.source,
            self.gemm.gflops or "not timed",
            self.gemm.plan.few_rows,
        )
        self.adapters = (
            AdapterSlots(
                self.model, config.max_loras, config.max_lora_rank, config.resolve_max_cpu_loras(), self.device
            )
            if config.enable_lora
            else None
        )
        kv_cache = self._allocate_kv_cache(budget, at_start)
        self.pool = BlockPool(self.num_blocks, config.enable_prefix_caching, extent_blocks(config.block_size))
        self.kv = KVCacheManager(self.pool, config.block_size, kv_cache.num_swap_blocks)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.preemption_mode,
            config.scheduling_policy,
            fair_budget,
            config.interrupt_max_num_batched_tokens if config.enable_step_interrupts else None,
            self.adapters,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        sampler = Sampler(
            self.generator, lambda t: self.tokenizer.decode([t], skip_special_tokens=False), self.eos_token_ids
        )
        self.runner = ModelRunner(self.model, kv_cache, sampler, config.block_size, self.device, self.adapters)
        self.grammar = GrammarTokenizer(self.tokenizer.backend, arch.vocab_size, sorted(self.eos_token_ids))
        self._groups: dict[str, RequestGroup] = {}
        self._owner: dict[Request, RequestGroup] = {}
        self._arrivals = itertools.count()
        self._num_added = 0
        self._in_flight: _InFlight | None = None
        self._deferred_aborts: list[str] = []
        self.steps_paused = 0
        self.step_interrupts = 0
        self.time_paused_s = 0.0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.peak_blocks_in_use = 0
        self.kv_utilization_at_peak = 0.0
        self.metrics = EngineMetrics()

    def _allocate_kv_cache(self, budget: int | None, at_start: DeviceMemory | None) -> KVCache:
        """The KV cache: `budget` bytes (None: measured from the memory left after loading), at most what every
        sequence at full length could use; sets `num_blocks`."""
        config, arch, precision = self.config, self.arch, self.precision
        if budget is None:
            assert at_start is not None
            budget = self._measure_kv_budget(at_start)
        per_block = KVCache.bytes_per_block(
            arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, precision.kv_cache
        )
        # More blocks than every sequence at full length could use would only cost memory and start-up time.
        useful = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        self.num_blocks = min(budget // per_block, useful)
        if self.num_blocks < 1:
            raise InvalidConfigError(
                f"kv_cache_memory_bytes={budget:,} is too small: one block of {config.block_size} tokens in all "
                f"{arch.num_layers} layers needs {per_block:,} bytes"
            )
        num_swap = config.swap_space_bytes // per_block if config.preemption_mode == "swap" else 0
        return KVCache(
            arch.num_layers,
            self.num_blocks,
            num_swap,
            config.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            precision.kv_cache,
            self.device,
        )

    def _measure_kv_budget(self, at_start: DeviceMemory) -> int:
        """CUDA: ``gpu_memory_utilization`` of the device's total memory, less the weights (already loaded) and
        the activations of the largest step (profiled here). See ``kv_budget``."""
        config = self.config

        def largest_step() -> None:
            profile_forward(
                self.model, self.max_num_batched_tokens, self.max_model_len, config.max_num_seqs, config.block_size
            )

        activation = peak_activation_bytes(self.device, largest_step)
        after_load = DeviceMemory.read(self.device)
        return cuda_kv_cache_bytes(config.gpu_memory_utilization, at_start, after_load, activation)

    # ---- requests in

    @property
    def limits(self) -> PromptLimits:
        """What `process_prompt` checks requests against (an API replica checks the same without the model)."""
        return PromptLimits(
            vocab_size=self.arch.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            kv_capacity_tokens=self.num_blocks * self.block_size,
        )

    def process_prompt(self, prompt: PromptInput, params: SamplingParams) -> list[int]:
        """Validate a prompt and its parameters against this engine (no state change); return its token ids.

        As vLLM v1, a prompt of ``max_model_len`` tokens or more is rejected: at least one token must fit after it.
        """
        return prompt_token_ids(prompt, params, self.tokenizer, self.limits)

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        tenant_id: str | None = None,
        *,
        delta: bool = False,
        prompt_text: str | None = None,
        tenant_weight: float = 1.0,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Queue a request. ``tenant_id`` salts its prefix-cache hashes and, with ``tenant_weight``, names its
        share under the ``fair`` scheduling policy. ``lora_request`` runs it under that adapter
        (``register_adapter``; its digest salts the prefix-cache hashes too). With ``delta``, ``step`` reports only
        what is new since the last report (the streaming form). ``prompt_text`` labels a pre-tokenized prompt.
        ``arrival_time`` (``time.monotonic()``, default now) is when the request arrived, for its queue time and
        latencies.
        ``priority`` (vLLM's: lower runs first) is its class: better classes are scheduled first."""
        if not (isinstance(tenant_weight, int | float) and 0 < tenant_weight <= 1e6):
            raise InvalidRequestError(f"tenant_weight must be a number in (0, 1e6], got {tenant_weight!r}")
        check_priority(priority)
        params = params or SamplingParams()
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self.process_prompt(prompt, params)
        adapter = None if lora_request is None else self.register_adapter(lora_request, tenant_id)
        arrival = next(self._arrivals)
        samples = []
        for index in range(params.n):
            sample_params = params.for_sample(index) if params.n > 1 else params
            request = Request(
                sample_id(request_id, index) if params.n > 1 else request_id,
                token_ids,
                sample_params,
                arrival,
                tenant_id,
                group_id=request_id,
                sample_index=index,
                priority=priority,
                adapter=adapter,
            )
            if sample_params.seed is not None:
                request.generator = torch.Generator(self.device).manual_seed(sample_params.seed)
            if sample_params.structured_outputs is not None:
                request.matcher = self.grammar.new_matcher(sample_params.structured_outputs)
            samples.append(
                SampleState(
                    request,
                    IncrementalDetokenizer(self.tokenizer, token_ids, sample_params.skip_special_tokens),
                )
            )
        longest_stop = max((len(s) for s in params.stop_strings), default=1)
        hold = 0 if params.include_stop_str_in_output else longest_stop - 1
        text = prompt if isinstance(prompt, str) else prompt_text
        metrics = RequestMetrics(time.monotonic() if arrival_time is None else arrival_time)
        group = RequestGroup(request_id, text, token_ids, samples, delta, hold, metrics=metrics)
        self._groups[request_id] = group
        for sample in samples:
            self._owner[sample.request] = group
        self.scheduler.add_request(samples[0].request, [s.request for s in samples[1:]], tenant_weight)
        self._num_added += 1

    def register_adapter(self, lora_request: LoRARequest, tenant_id: str | None = None) -> str:
        """Read and check ``lora_request``'s adapter (unless its id is known) and return the key ``tenant_id``'s
        requests under it are scheduled by (``AdapterSlots.register``); raises ``InvalidRequestError``
        (``AdapterError``) for an adapter this engine cannot serve, or when LoRA is off."""
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest, got {lora_request!r}")
        if self.adapters is None:
            raise InvalidRequestError(
                "this engine serves no adapters: start it with enable_lora=True", param="lora_request"
            )
        return self.adapters.register(lora_request, tenant_id)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request (all its samples) and free its blocks now. Returns its final output (unfinished
        samples end with ``finish_reason="abort"``); unknown ids are ignored and return None. A request with a
        sample in the step in flight is dropped when that step ends: its final output comes from that ``step``."""
        group = self._groups.get(request_id)
        if group is None:
            return None
        flight = self._in_flight
        if flight is not None and any(s.request in flight.step.scheduled for s in group.samples):
            self._deferred_aborts.append(request_id)
            return None
        self._end(group, "abort")
        return group.output()

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def request_usage(self, request_id: str) -> RequestUsage | None:
        """A live request's usage so far; None for unknown (or already finished) ids."""
        group = self._groups.get(request_id)
        return None if group is None else group.usage

    # ---- one step

    def step(self, poll: Callable[[], None] | None = None) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that made progress or failed.

        With ``poll`` (applies the messages that arrived) and ``enable_step_interrupts``, the step may pause
        between two parts of a layer for an interrupting step: this call then reports that step, and the next call
        resumes the paused one (see the module's docstring). Raises ``StepFailedError`` (engine consistent, the step's
        requests failed) when batch-wide work fails.
        """
        flight = self._in_flight
        if flight is None:
            flight = self._start_step()
            if flight is None:
                return []
        try:
            while not flight.run.done:
                flight.run.run_part()
                if not flight.run.done and self._may_interrupt(flight, poll):
                    interrupting = self._interrupt(flight)
                    if interrupting is not None:
                        return interrupting
            samples = self.runner.finish(flight.run)
        except Exception as error:
            self._in_flight, self._deferred_aborts = None, []  # the step's groups fail, the aborted ones too
            self.scheduler.complete(flight.step)
            raise self._fail_step("the forward pass", error, self._touched(flight.step)) from error
        self._in_flight = None
        self.scheduler.complete(flight.step)
        outputs = self._apply(flight.step, samples, flight.started)
        deferred, self._deferred_aborts = self._deferred_aborts, []
        aborted = [self.abort_request(request_id) for request_id in deferred]
        return outputs + [output for output in aborted if output is not None]

    def _start_step(self) -> _InFlight | None:
        """Schedule the next step and start its forward pass; None if it has no work."""
        started = time.monotonic()
        try:
            step = self.scheduler.schedule()
        except Exception as error:
            self.kv.take_block_ops()  # the copies of a half-made schedule must never run
            raise self._fail_step("scheduling", error, [*self.scheduler.running, *self.scheduler.swapped]) from error
        if step.is_empty:  # it may still have preempted a request (that then preempted itself)
            self.scheduler.complete(step)
            self.metrics.stepped(step, self._owner, started, started)
            return None
        try:
            run = self.runner.start(step)
        except Exception as error:
            self.scheduler.complete(step)
            raise self._fail_step("the forward pass", error, self._touched(step)) from error
        self._in_flight = _InFlight(step, run, started, self._num_added)
        return self._in_flight

    def _may_interrupt(self, flight: _InFlight, poll: Callable[[], None] | None) -> bool:
        """Between two layers: apply what arrived (``poll``), then whether to look for an interrupting step —
        interrupts are on, the step has not used up its interrupts, and (unless forced) a request was added since
        the step last looked."""
        config = self.config
        if config.force_step_interrupts:
            return True
        if not config.enable_step_interrupts or flight.interrupts >= config.max_interrupts_per_step or poll is None:
            return False
        poll()
        return flight.checked_at_add < self._num_added

    def _interrupt(self, flight: _InFlight) -> list[RequestOutput] | None:
        """Run a step for the requests owed service ahead of ``flight`` (which stays in flight, paused), and
        report it; None (nothing run) if nobody owed one fits."""
        flight.checked_at_add = self._num_added
        paused_at = time.monotonic()
        try:
            step = self.scheduler.schedule_interrupt(
                flight.step, self.config.interrupt_max_num_batched_tokens, anyone=self.config.force_step_interrupts
            )
        except Exception as error:  # the scheduler cannot be trusted: the paused step goes down with it
            self.kv.take_block_ops()
            self._in_flight, self._deferred_aborts = None, []
            self.scheduler.complete(flight.step)
            raise self._fail_step("scheduling", error, [*self.scheduler.running, *self.scheduler.swapped]) from error
        if step.is_empty:
            return None
        self.steps_paused += flight.interrupts == 0
        flight.interrupts += 1
        self.step_interrupts += 1
        try:
            samples = self.runner.execute(step)
        except Exception as error:
            raise self._fail_step("the forward pass", error, self._touched(step)) from error
        finally:
            self.time_paused_s += time.monotonic() - paused_at
        return self._apply(step, samples, paused_at)

    def _apply(
        self, step: SchedulerOutput, samples: dict[Request, SampleResult | Exception], started: float
    ) -> list[RequestOutput]:
        """Record a step that has run: its computed tokens, its samples; its requests' outputs."""
        self.metrics.stepped(step, self._owner, started, time.monotonic())
        failed: list[RequestOutput] = []
        for request, num_new in step.scheduled.items():
            group = self._owner.get(request)
            if group is None:  # failed earlier in this step (a sibling sample)
                continue
            try:
                self._computed(group, request, num_new)
            except Exception as error:  # noqa: BLE001 - contained to this request
                failed.append(self._fail(group, "recording its computed tokens", error))
        self._track_utilization()
        for request, result in samples.items():
            group = self._owner.get(request)
            if group is None:
                continue
            if isinstance(result, Exception):
                failed.append(self._fail(group, "sampling its next token", result))
                continue
            try:
                self._append(group, request, result)
            except Exception as error:  # noqa: BLE001 - contained to this request
                failed.append(self._fail(group, "processing its new token", error))
        return failed + self._collect_outputs(samples)

    def _computed(self, group: RequestGroup, request: Request, num_new: int) -> None:
        """The one place a step's computed tokens are applied (and the prompt high-water mark advances).

        ``prompt_tokens_total`` grows with the high-water marks, so over any interval it equals the prompt tokens
        the engine's requests were billed for (prefix hits included, recomputes not counted twice)."""
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        if num_new:  # a fork (0 new tokens) reached the prompt through its leader
            reached = group.num_prompt_reached
            group.record_prompt_progress(start, request.num_computed_tokens)
            self.prompt_tokens_total += group.num_prompt_reached - reached
        self.kv.register_full_blocks(request)

    def _append(self, group: RequestGroup, request: Request, result: SampleResult) -> None:
        request.append_token(result.token_id)
        group.num_generated += 1
        self.generation_tokens_total += 1
        self.metrics.token(group, request)
        group.changed = True
        if result.logprobs is not None:
            request.output_logprobs.append(result.logprobs)
        if request.matcher is not None:
            advance(request.matcher, result.token_id)
        finish = group.sample_of(request).after_token(result.token_id, self.eos_token_ids, self.max_model_len)
        if finish is None and request.matcher is not None and request.matcher.is_stopped():
            finish = group.sample_of(request).grammar_complete()  # the document is whole: nothing may follow
        if finish is not None:
            request.finish_reason, request.stop_reason = finish
            self.scheduler.finish(request)  # its blocks are free for the next step

    # ---- failures

    def _end(self, group: RequestGroup, reason: str) -> None:
        """Finish every unfinished sample of ``group`` with ``reason``, free its blocks, forget the group."""
        for sample in group.samples:
            if not sample.request.finished:
                self.scheduler.finish(sample.request)
                sample.request.finish_reason = reason
        self._forget(group)

    def _fail(self, group: RequestGroup, what: str, error: Exception, *, log: bool = True) -> RequestOutput:
        if log:
            _logger.warning("request %r failed while %s", group.request_id, what, exc_info=error)
        self._end(group, "error")
        failure = RequestFailedError(f"the request failed while {what}: {type(error).__name__}: {error}")
        failure.__cause__ = error
        return group.output(failure)

    def _fail_step(self, what: str, error: Exception, requests: Iterable[Request]) -> StepFailedError:
        """Fail the groups of ``requests`` after batch-wide work raised; verify that every block is accounted."""
        groups = list(dict.fromkeys(self._owner[r] for r in requests if r in self._owner))
        _logger.error("the step failed during %s; failing its %d requests", what, len(groups), exc_info=error)
        outputs = [self._fail(group, what, error, log=False) for group in groups]
        self.kv.check_accounting(self._live_requests())
        return StepFailedError(f"the step failed during {what} ({error!r}); {len(outputs)} requests failed", outputs)

    def _touched(self, step: SchedulerOutput) -> list[Request]:
        """Requests whose KV this step's copies or forward pass may have left half-written: the scheduled ones,
        the ones swapped out in it, and running ones swapped in by it."""
        swapped_in = {op.dst for op in step.block_ops if op.kind == "swap_in"}
        swapped_out = [r for r in step.preempted if r.status is RequestStatus.SWAPPED]
        brought_back = [r for r in self.scheduler.running if swapped_in.intersection(r.block_ids)]
        return [*step.scheduled, *swapped_out, *brought_back]

    def _live_requests(self) -> list[Request]:
        return [s.request for g in self._groups.values() for s in g.samples if not s.request.finished]

    def _forget(self, group: RequestGroup) -> None:
        del self._groups[group.request_id]
        for sample in group.samples:
            self._owner.pop(sample.request, None)

    # ---- outputs

    def _collect_outputs(self, samples: dict[Request, SampleResult | Exception]) -> list[RequestOutput]:
        outputs = []
        for request in samples:
            group = self._owner.get(request)
            if group is None or not group.changed:
                continue
            group.changed = False
            if group.finished:  # every sample stopped on its own: failed and aborted groups are gone already
                self.metrics.finished(group)
            outputs.append(group.output())
            if group.finished:
                self._forget(group)
        return outputs

    def _track_utilization(self) -> None:
        in_use = self.num_blocks - self.pool.num_free
        if in_use > self.peak_blocks_in_use:
            live = sum(r.num_computed_tokens for r in self.scheduler.running)
            self.peak_blocks_in_use = in_use
            self.kv_utilization_at_peak = min(1.0, live / (in_use * self.block_size))

    # ---- introspection

    def _adapter_stats(self) -> dict[str, Any]:
        """Adapter slots: how many, which adapters are resident (key -> running requests), slot loads and
        file reads so far; empty with LoRA off."""
        slots = self.adapters
        if slots is None:
            return {}
        return {"max_loras": slots.max_loras, "resident": slots.resident(), "loads": slots.loads, "reads": slots.reads}

    def stats(self) -> dict[str, Any]:
        """Counters, gauges and histograms (``HistogramSnapshot``s, see ``request_metrics``) with vLLM's meanings;
        under the ``fair`` policy, ``tenants`` holds each active tenant's served-token counter, weight and
        running / waiting sequences."""
        free = self.pool.num_free
        s = self.scheduler
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting) + sum(len(f) for f in s.pending_forks.values()),
            "num_requests_swapped": len(s.swapped),
            "kv_blocks_total": self.num_blocks,
            "kv_blocks_free": free,
            "kv_cache_usage_perc": (self.num_blocks - free) / self.num_blocks,
            "num_preemptions": s.stats.num_preemptions,
            "num_swapped_out_blocks": s.stats.num_swapped_out_blocks,
            "num_swapped_requests": len(s.swapped),
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_queries": s.stats.prefix_cache_queries,
            "prefix_cache_hits": s.stats.prefix_cache_hits,
            "scheduling_policy": self.config.scheduling_policy,
            "steps_paused": self.steps_paused,
            "step_interrupts": self.step_interrupts,
            "step_time_paused_seconds": self.time_paused_s,
            "gemm_path": self.gemm.plan.describe(),
            "gemm_path_source": self.gemm.source,
            "gemm_few_rows": self.gemm.plan.few_rows,
            "precision": self.precision.describe(),
            "tenants": s.fair.snapshot(s.waiting, s.running) if s.fair is not None else {},
            "lora": self._adapter_stats(),
            **self.metrics.snapshots(),
        }

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash. Refused (returns False, changes nothing) while any block is in use."""
        return self.pool.reset_prefix_cache()

