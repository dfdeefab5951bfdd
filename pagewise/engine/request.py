"""A request's state as it moves through the engine (one sample = one ``Request``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from pagewise.engine.block_pool import hash_block_tokens
from pagewise.engine.outputs import Logprob
from pagewise.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Request:
    """One sequence: its prompt, its generated tokens and where its KV lives.

    Invariants: ``num_computed_tokens <= len(token_ids)``; the KV of tokens ``[0, num_computed_tokens)`` sits in
    ``block_ids`` (slot ``block_ids[i // block_size] * block_size + i % block_size``); ``block_hashes[i]`` is the
    chain hash of the i-th full block of ``token_ids`` (tenant salt, and the adapter's digest when it runs under
    one, in block 0: the same prompt under two adapters has different KV) and never changes.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_seq: int
    tenant_id: str | None = None
    group_id: str = ""
    sample_index: int = 0
    priority: int = 0  # vLLM's meaning: lower runs first
    adapter: str | None = None  # the digest of the LoRA adapter it runs under (adapter_slots.py); None: base model
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_charged_tokens: int = 0  # positions charged to the tenant's fair share (a high-water mark)
    block_ids: list[int] = field(default_factory=list)
    swap_slots: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    generator: torch.Generator | None = None
    output_logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    matcher: Any = None  # its llguidance matcher when its params carry structured_outputs (grammar_matcher.py)
    # lifecycle bookkeeping of `pagewise.engine.request_metrics` (no effect on scheduling)
    prefill_end: int = 0  # the position its current prefill runs to: a scheduled chunk starting before it is prefill
    preempted_mode: str | None = None  # "swap" or "recompute" from its preemption until it is scheduled again
    last_token_time: float | None = None  # when its latest token was sampled (time.monotonic())

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.group_id = self.group_id or self.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def full_block_hashes(self, block_size: int, num_tokens: int) -> list[bytes]:
        """Hashes of the full blocks among the first ``num_tokens`` tokens, computed once and memoized."""
        while (len(self.block_hashes) + 1) * block_size <= num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if self.block_hashes else None
            extra = () if i else (self.tenant_id,) if self.adapter is None else (self.tenant_id, self.adapter)
            tokens = self.token_ids[i * block_size : (i + 1) * block_size]
            self.block_hashes.append(hash_block_tokens(parent, tokens, extra))
        return self.block_hashes[: num_tokens // block_size]
