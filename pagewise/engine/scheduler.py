"""Continuous batching under one token budget per step.

Each step, every scheduled request's computed tokens catch up with its tokens: a decode needs one, a prefill
needs its prompt, a chunk of a prefill needs whatever budget remains. Running requests go first (oldest first),
then swapped ones come back, then waiting ones are admitted in arrival order. When a running request cannot get
a block, the most recently arrived running request is preempted — swapped to host memory
(``preemption_mode="swap"``, while it is decoding and host slots remain) or freed and requeued at the front of
the waiting queue for recompute.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

from pagewise.engine.kv_cache_manager import BlockOp, KVCacheManager
from pagewise.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. ``scheduled`` maps requests to their number of new tokens, in batch order; a forked
    sample is scheduled with 0 tokens and samples from its leader's logits (``sample_sources``)."""

    scheduled: dict[Request, int] = field(default_factory=dict)
    sample_sources: dict[Request, Request] = field(default_factory=dict)
    block_ops: list[BlockOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.scheduled.values())

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_swapped_out_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


def _order(request: Request) -> tuple[int, int]:
    return request.arrival_seq, request.sample_index


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        preemption_mode: str,
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: running[-1] is the preemption victim
        self.swapped: deque[Request] = deque()
        self.pending_forks: dict[Request, list[Request]] = {}
        self.stats = SchedulerStats()
        self._budget = 0

    def add_request(self, leader: Request, followers: list[Request] | None = None) -> None:
        """Queue a request; ``followers`` (samples 1..n-1) fork from it when its prefill completes."""
        self.waiting.append(leader)
        if followers:
            self.pending_forks[leader] = followers

    @property
    def num_unfinished(self) -> int:
        pending = sum(len(f) for f in self.pending_forks.values())
        return len(self.waiting) + len(self.running) + len(self.swapped) + pending

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._budget = self.max_num_batched_tokens
        preempted = self._schedule_running(out)
        if not preempted:
            self._schedule_swapped(out)
        if not preempted and not self.swapped:
            self._schedule_waiting(out)
        out.block_ops = self.kv.take_block_ops()
        return out

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        preempted = False
        i = 0
        while i < len(self.running) and self._budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, self._budget)
            if num_new <= 0:  # a sample forked in this very step
                i += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    return preempted
            self._add(out, request, num_new)
            i += 1
        return preempted

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if not self.kv.swap_in(request):
                return
            self.swapped.popleft()
            self._start(request)
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new <= self._budget and self.kv.allocate_slots(request, num_new):
                self._add(out, request, num_new)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        while self.waiting and self._budget > 0:
            request = self.waiting[0]
            group_size = 1 + len(self.pending_forks.get(request, ()))
            if len(self.running) + group_size > self.max_num_seqs:
                return
            prefix = self.kv.lookup_prefix(request)
            num_new = request.num_tokens - len(prefix) * self.kv.block_size
            if num_new > self._budget:
                if not self.enable_chunked_prefill:
                    return
                num_new = self._budget
            if not self.kv.allocate_slots(request, num_new, prefix):
                return
            self.waiting.popleft()
            if request.num_output_tokens == 0:
                request.num_cached_tokens = request.num_computed_tokens
            self.stats.prefix_cache_queries += request.num_tokens
            self.stats.prefix_cache_hits += request.num_computed_tokens
            self._start(request)
            self._add(out, request, num_new)

    def _start(self, request: Request) -> None:
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_order)

    def _add(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.scheduled[request] = num_new
        self._budget -= num_new
        followers = self.pending_forks.get(request)
        if followers and request.num_computed_tokens + num_new == request.num_tokens:
            del self.pending_forks[request]
            for follower in followers:
                self.kv.fork(request, follower)
                follower.num_computed_tokens = request.num_tokens
                follower.num_cached_tokens = request.num_cached_tokens
                self._start(follower)
                out.scheduled[follower] = 0
                out.sample_sources[follower] = request

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self._budget += out.scheduled.pop(victim, 0)
        out.sample_sources.pop(victim, None)
        out.preempted.append(victim)
        self.stats.num_preemptions += 1
        decoding = victim.num_computed_tokens == victim.num_tokens - 1
        num_blocks = len(victim.block_ids)
        if self.preemption_mode == "swap" and decoding and self.kv.swap_out(victim):
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
            self.stats.num_swapped_out_blocks += num_blocks
            return
        self.kv.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        self.waiting.appendleft(victim)

    def finish(self, request: Request) -> None:
        """Remove a request from wherever it is and release its blocks and swap slots (same step)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.SWAPPED:
            self.swapped.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for leader, followers in list(self.pending_forks.items()):
            if request in followers:
                followers.remove(request)
            if leader is request:
                del self.pending_forks[leader]
        self.kv.free(request)
        self.kv.release_swap(request)
        request.status = RequestStatus.FINISHED
