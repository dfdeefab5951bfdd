"""``LLM``: the offline, batch-at-once interface (vLLM's ``LLM`` class)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagewise.engine.beam_search import BeamSearchOutput, BeamSearchParams
from pagewise.engine.beam_search import beam_search as _beam_search
from pagewise.engine.config import EngineConfig
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.limits import check_priority
from pagewise.engine.llm_engine import LLMEngine, PromptInput
from pagewise.engine.loader import DEFAULT_MODEL
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.outputs import RequestOutput
from pagewise.engine.sampling_params import SamplingParams


class LLM:
    """``LLM(model, **engine_args).generate(prompts, sampling_params)``: run prompts to completion.

    ``engine_args`` are ``EngineConfig`` fields (``block_size``, ``max_num_seqs``, ``kv_cache_memory_bytes``, …).
    """

    def __init__(self, model: str = DEFAULT_MODEL, *, progress: bool = True, **engine_args) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **engine_args), progress=progress)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, *, progress: bool = True) -> LLM:
        fields = {name: getattr(config, name) for name in config.__dataclass_fields__ if name != "model"}
        return cls(config.model, progress=progress, **fields)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tenant_id: str | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order. A prompt is a ``str`` or a list of token
        ids; ``priority`` (vLLM's), one per prompt, lower first; ``lora_request`` (vLLM's), one for all prompts or
        one per prompt (None: the base model) — needs ``enable_lora=True``. All prompts and adapters are validated
        before any is queued, so a bad one leaves the engine untouched. A request failing inside the engine raises its
        ``RequestFailedError`` (a failed step, ``StepFailedError``) and aborts the rest of the batch."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        if priority is not None and len(priority) != len(batch):
            raise InvalidRequestError(f"priority has {len(priority)} entries for {len(batch)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(batch)
        for value in priorities:
            check_priority(value)
        token_ids = [self.engine.process_prompt(prompt, p) for prompt, p in zip(batch, params, strict=True)]
        adapters = _per_prompt_adapter(lora_request, len(batch))
        for adapter in adapters:
            if adapter is not None:
                self.engine.register_adapter(adapter)
        ids = [f"llm-{next(self._ids)}" for _ in batch]
        try:
            for request_id, prompt, tokens, p, rank, adapter in zip(
                ids, batch, token_ids, params, priorities, adapters, strict=True
            ):
                text = prompt if isinstance(prompt, str) else None
                self.engine.add_request(
                    request_id, tokens, p, tenant_id, prompt_text=text, priority=rank, lora_request=adapter
                )
            return self._run(ids, use_tqdm)
        finally:
            for request_id in ids:
                self.engine.abort_request(request_id)

    def chat(
        self,
        messages: list[dict[str, str]] | Sequence[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        tenant_id: str | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt=True) for c in conversations]
        return self.generate(prompts, sampling_params, tenant_id, use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        params: BeamSearchParams,
        tenant_id: str | None = None,
    ) -> list[BeamSearchOutput]:
        """Beam search for every prompt (HF transformers' ``num_beams`` semantics; see
        ``pagewise.engine.beam_search``); one ``BeamSearchOutput`` per prompt, in input order, each with
        ``beam_width`` finished sequences best first. Runs on top of the engine: every step submits each live
        beam as a one-token request, and the prefix cache keeps each shared full block of KV once."""
        batch = _as_batch(prompts)
        return _beam_search(self.engine, batch, params, tenant_id, lambda: f"llm-beam-{next(self._ids)}")

    def stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False (nothing changed) while requests hold blocks."""
        return self.engine.reset_prefix_cache()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm)
        with bar:
            while len(results) < len(ids):
                if not self.engine.has_unfinished_requests():
                    raise RuntimeError("engine stopped with requests unfinished")
                for output in self.engine.step():
                    if output.error is not None:
                        raise output.error
                    if output.finished:
                        results[output.request_id] = output
                        bar.update(1)
        return [results[i] for i in ids]


def _as_batch(prompts: PromptInput | Sequence[PromptInput]) -> list[PromptInput]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence):
        raise InvalidRequestError(f"prompts must be a str, a list of token ids or a list of those, got {prompts!r}")
    prompts = list(prompts)
    if not prompts:
        raise InvalidRequestError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise InvalidRequestError(f"got {len(params)} sampling params for {count} prompts")
    return params


def _per_prompt_adapter(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, count: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * count
    adapters = list(lora_request)
    if len(adapters) != count:
        raise InvalidRequestError(f"got {len(adapters)} lora requests for {count} prompts")
    for adapter in adapters:
        if adapter is not None and not isinstance(adapter, LoRARequest):
            raise InvalidRequestError(f"lora_request must be a LoRARequest or None, got {adapter!r}")
    return adapters
