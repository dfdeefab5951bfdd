"""``LLMEngine``: requests in, one scheduled step at a time, ``RequestOutput``s out."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagewise.engine.block_pool import BlockPool
from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import InvalidConfigError, InvalidRequestError, PromptTooLongError
from pagewise.engine.kv_cache_manager import KVCacheManager
from pagewise.engine.loader import load_model
from pagewise.engine.model_runner import KVCache, ModelRunner
from pagewise.engine.models.llama import LlamaForCausalLM, skip_weight_init
from pagewise.engine.outputs import CompletionOutput, RequestOutput
from pagewise.engine.request import Request
from pagewise.engine.sampler import Sampler, SampleResult
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.scheduler import Scheduler, SchedulerOutput
from pagewise.engine.tokenizer import IncrementalDetokenizer

PromptInput = str | Sequence[int]


@dataclass(slots=True, eq=False)
class _Sample:
    """One sample's output state: text so far (cut at a stop string) and what a delta consumer has seen."""

    request: Request
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    finish_sent: bool = False


@dataclass(slots=True, eq=False)
class _Group:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    samples: list[_Sample]
    delta: bool
    hold_back: int = 0
    changed: bool = field(default=False)

    @property
    def finished(self) -> bool:
        return all(s.request.finished for s in self.samples)


class LLMEngine:
    """Owns the model, the KV cache, the scheduler and every live request. Not thread-safe: one thread drives
    it (``AsyncLLMEngine`` wraps it for asyncio). A rejected ``add_request`` leaves no trace."""

    def __init__(self, config: EngineConfig, *, progress: bool = True) -> None:
        self.config = config
        self.device = torch.device(config.device)
        loaded = load_model(
            config.model, dtype=config.torch_dtype, cache_dir=config.cache_dir, progress=progress
        )
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = frozenset(loaded.generation_eos_token_ids)
        arch = loaded.arch
        self.arch = arch
        self.max_model_len = config.resolve_max_model_len(arch.max_position_embeddings)
        self.max_num_batched_tokens = config.resolve_max_num_batched_tokens(self.max_model_len)
        self.block_size = config.block_size
        per_block = KVCache.bytes_per_block(
            arch.num_layers, config.block_size, arch.num_kv_heads, arch.head_dim, config.torch_dtype
        )
        budget = config.resolve_kv_cache_bytes()
        # More blocks than every sequence at full length could use would only cost memory and start-up time.
        useful = config.max_num_seqs * -(-self.max_model_len // config.block_size)
        self.num_blocks = min(budget // per_block, useful)
        if self.num_blocks < 1:
            raise InvalidConfigError(
                f"kv_cache_memory_bytes={budget:,} is too small: one block of {config.block_size} tokens in all "
                f"{arch.num_layers} layers needs {per_block:,} bytes"
            )
        num_swap = config.swap_space_bytes // per_block if config.preemption_mode == "swap" else 0
        with skip_weight_init():
            model = LlamaForCausalLM(arch, self.max_model_len).to(config.torch_dtype)
        model.load_hf_weights(loaded.weights)
        del loaded
        self.model = model.to(self.device).eval()
        kv_cache = KVCache(
            arch.num_layers,
            self.num_blocks,
            num_swap,
            config.block_size,
            arch.num_kv_heads,
            arch.head_dim,
            config.torch_dtype,
            self.device,
        )
        self.pool = BlockPool(self.num_blocks, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool, config.block_size, num_swap)
        self.scheduler = Scheduler(
            self.kv,
            config.max_num_seqs,
            self.max_num_batched_tokens,
            config.enable_chunked_prefill,
            config.preemption_mode,
        )
        self.generator = torch.Generator(self.device).manual_seed(config.seed)
        sampler = Sampler(self.generator, lambda t: self.tokenizer.decode([t], skip_special_tokens=False))
        self.runner = ModelRunner(self.model, kv_cache, sampler, config.block_size, self.device)
        self._groups: dict[str, _Group] = {}
        self._owner: dict[Request, _Group] = {}
        self._arrivals = itertools.count()
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.peak_blocks_in_use = 0
        self.kv_utilization_at_peak = 0.0

    # ---- requests in

    def process_prompt(self, prompt: PromptInput, params: SamplingParams) -> list[int]:
        """Validate a prompt against this engine (no state change) and return its token ids."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty")
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence):
            token_ids = list(prompt)
            bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < self.arch.vocab_size]
            if bad:
                raise InvalidRequestError(
                    f"prompt token ids must be integers in [0, {self.arch.vocab_size}); got {bad[0]!r}"
                )
        else:
            raise InvalidRequestError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")
        if not token_ids:
            raise InvalidRequestError("prompt is empty")
        if len(token_ids) >= self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)
        if params.n > self.config.max_num_seqs:
            raise InvalidRequestError(f"n={params.n} exceeds max_num_seqs={self.config.max_num_seqs}")
        need = min(len(token_ids) + params.max_tokens, self.max_model_len)
        capacity = self.num_blocks * self.block_size
        if need > capacity:
            raise InvalidRequestError(
                f"request needs up to {need:,} tokens of KV cache but the whole cache holds {capacity:,}; "
                "lower max_tokens or raise kv_cache_memory_bytes"
            )
        return token_ids

    def add_request(
        self,
        request_id: str,
        prompt: PromptInput,
        params: SamplingParams | None = None,
        tenant_id: str | None = None,
        *,
        delta: bool = False,
        prompt_text: str | None = None,
    ) -> None:
        """Queue a request. ``tenant_id`` salts its prefix-cache hashes. With ``delta``, ``step`` reports only
        what is new since the last report (the streaming form). ``prompt_text`` labels a pre-tokenized prompt."""
        params = params or SamplingParams()
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        token_ids = self.process_prompt(prompt, params)
        arrival = next(self._arrivals)
        samples = []
        for index in range(params.n):
            sample_params = params.for_sample(index) if params.n > 1 else params
            request = Request(
                f"{request_id}#{index}" if params.n > 1 else request_id,
                token_ids,
                sample_params,
                arrival,
                tenant_id,
                group_id=request_id,
                sample_index=index,
            )
            if sample_params.seed is not None:
                request.generator = torch.Generator(self.device).manual_seed(sample_params.seed)
            samples.append(
                _Sample(
                    request,
                    IncrementalDetokenizer(self.tokenizer, token_ids, sample_params.skip_special_tokens),
                )
            )
        hold = max((len(s) for s in params.stop_strings), default=1) - 1
        text = prompt if isinstance(prompt, str) else prompt_text
        group = _Group(request_id, text, token_ids, samples, delta, hold)
        self._groups[request_id] = group
        for sample in samples:
            self._owner[sample.request] = group
        self.scheduler.add_request(samples[0].request, [s.request for s in samples[1:]])
        self.prompt_tokens_total += len(token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Drop a request (all its samples) and free its blocks now. Returns its final output (unfinished
        samples end with ``finish_reason="abort"``); unknown ids are ignored and return None."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        for sample in group.samples:
            if not sample.request.finished:
                self.scheduler.finish(sample.request)
                sample.request.finish_reason = "abort"
            self._owner.pop(sample.request, None)
        return self._output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    # ---- one step

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report every request that made progress."""
        step = self.scheduler.schedule()
        if step.is_empty:
            return []
        samples = self.runner.execute(step)
        for request, num_new in step.scheduled.items():
            request.num_computed_tokens += num_new
            self.kv.register_full_blocks(request)
        self._track_utilization()
        for request, result in samples.items():
            self._append(request, result)
        return self._collect_outputs(step, samples)

    def _append(self, request: Request, result: SampleResult) -> None:
        group = self._owner[request]
        sample = next(s for s in group.samples if s.request is request)
        request.append_token(result.token_id)
        self.generation_tokens_total += 1
        if result.logprobs is not None:
            request.output_logprobs.append(result.logprobs)
        params = request.params
        previous_len = len(sample.text)
        sample.text += sample.detokenizer.push(result.token_id)
        group.changed = True
        if not params.ignore_eos and result.token_id in self.eos_token_ids:
            self._finish(sample, "stop")
        elif params.stop_token_ids and result.token_id in params.stop_token_ids:
            self._finish(sample, "stop", result.token_id)
        elif params.stop_strings and self._cut_at_stop(sample, previous_len):
            return
        elif request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.max_model_len:
            self._finish(sample, "length")

    def _cut_at_stop(self, sample: _Sample, previous_len: int) -> bool:
        strings = sample.request.params.stop_strings
        start = max(0, previous_len - max(len(s) for s in strings) + 1)
        found = [(sample.text.find(s, start), s) for s in strings]
        found = [(pos, s) for pos, s in found if pos >= 0]
        if not found:
            return False
        pos, stop = min(found)
        sample.text = sample.text[:pos]
        self._finish(sample, "stop", stop, flush=False)
        return True

    def _finish(self, sample: _Sample, reason: str, stop_reason: str | int | None = None, flush: bool = True) -> None:
        """End a sample and free its blocks in this step; ``flush`` releases any text the detokenizer held."""
        if flush:
            sample.text += sample.detokenizer.flush()
        request = sample.request
        request.finish_reason = reason
        request.stop_reason = stop_reason
        self.scheduler.finish(request)

    def _collect_outputs(
        self, step: SchedulerOutput, samples: dict[Request, SampleResult]
    ) -> list[RequestOutput]:
        outputs = []
        for request in samples:
            group = self._owner.get(request)
            if group is None or not group.changed:
                continue
            group.changed = False
            outputs.append(self._output(group))
            if group.finished:
                del self._groups[group.request_id]
                for sample in group.samples:
                    self._owner.pop(sample.request, None)
        return outputs

    def _output(self, group: _Group) -> RequestOutput:
        completions = []
        for index, sample in enumerate(group.samples):
            request = sample.request
            visible = len(sample.text) if request.finished else max(0, len(sample.text) - group.hold_back)
            if group.delta:
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
        return RequestOutput(
            group.request_id,
            group.prompt_token_ids,
            completions,
            group.finished,
            group.samples[0].request.num_cached_tokens,
            group.prompt,
        )

    def _track_utilization(self) -> None:
        in_use = self.num_blocks - self.pool.num_free
        if in_use > self.peak_blocks_in_use:
            live = sum(r.num_computed_tokens for r in self.scheduler.running)
            self.peak_blocks_in_use = in_use
            self.kv_utilization_at_peak = min(1.0, live / (in_use * self.block_size))

    # ---- introspection

    def stats(self) -> dict[str, float | int]:
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
        }

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
