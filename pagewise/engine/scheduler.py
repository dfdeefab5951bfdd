"""Continuous batching under one token budget per step.

Each step, every scheduled request's computed tokens catch up with its tokens: a decode needs one, a prefill
needs its prompt, a chunk of a prefill needs whatever budget remains. When a running request cannot get a block,
a running request is preempted — swapped to host memory (``preemption_mode="swap"``, while it is decoding and
host slots remain) or freed and requeued at the front of the waiting queue for recompute.

Two policies decide the order:
- ``fcfs``: running requests first (oldest first), then swapped ones come back, then waiting ones are admitted in
  arrival order; the victim of a preemption is the most recently arrived running request.
- ``fair``: tenants share the engine by weighted served tokens (``fair_share.py``). Decodes go first (one token
  each, least-served tenant first), then swapped requests come back, then the prefill work — chunks of running
  prompts and admissions of waiting requests alike — goes to the least-served tenant first, each tenant's own
  requests in arrival order; the victim is the newest running request of the most-served tenant. So a tenant's
  flood of long prompts cannot hold the budget while another tenant waits for its first token. While two or more
  tenants have had work within ``fair_share.RECENT_STEPS`` steps, a step's budget is the shared one
  (``shared_max_num_batched_tokens``, by default the full one).

Adapters: a request under a LoRA adapter starts running only when its adapter has or can get a slot
(``adapter_slots``), and pins it while it runs; a waiting request whose adapter cannot get a slot is passed over,
not waited for, so requests of resident adapters keep the batch full.

Priorities (vLLM's ``priority``: an integer, lower runs first) come before either policy: a request of a better
class is scheduled first and a request of the worst class running is the first victim; the policy orders requests
within a class.

**Interrupting steps.** While a step is paused between two parts (``LLMEngine``), ``schedule_interrupt`` may plan
one short step for the requests owed service ahead of it: requests of a strictly better class than every request
in the paused step, or, under ``fair``, requests of a tenant whose counter is more than
``fair_share.INTERRUPT_THRESHOLD`` below every other tenant's in it (so a flood's own arrivals never interrupt
it). The interrupting step never touches the paused step: it uses only requests not in it (nor in its requests'
groups), never preempts, swaps or forks into anything the paused step holds, and takes blocks only from the free
pool — so no slot the paused step writes is read or written by it. (A block the paused step writes is never a
prefix-cache hit: full blocks are registered only after their step has finished.) By the same rule, a step
scheduled while waiting requests are owed service ahead of the running ones admits them first and is kept short
(``_step_budget``): an arrival that a step in flight could not see does not wait for a long step either.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagewise.engine.fair_share import FairShare, tenant_of
from pagewise.engine.kv_cache_manager import BlockOp, KVCacheManager
from pagewise.engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagewise.engine.adapter_slots import AdapterSlots

POLICIES = ("fcfs", "fair")


@dataclass(slots=True)
class SchedulerOutput:
    """One step's work. ``scheduled`` maps requests to their number of new tokens, in batch order; a forked
    sample is scheduled with 0 tokens and samples from its leader's logits (``sample_sources``)."""

    scheduled: dict[Request, int] = field(default_factory=dict)
    sample_sources: dict[Request, Request] = field(default_factory=dict)
    block_ops: list[BlockOp] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    charges: dict[str, float] = field(default_factory=dict)  # fair: each tenant's cost of this step
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


def _to_compute(request: Request) -> int:
    return request.num_tokens - request.num_computed_tokens


def _class_order(request: Request) -> tuple[int, int, int]:
    return request.priority, request.arrival_seq, request.sample_index


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_chunked_prefill: bool,
        preemption_mode: str,
        policy: str = "fcfs",
        shared_max_num_batched_tokens: int | None = None,
        interrupt_budget: int | None = None,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.kv = kv
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.enable_chunked_prefill = enable_chunked_prefill
        self.preemption_mode = preemption_mode
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival: running[-1] is the preemption victim
        self.swapped: deque[Request] = deque()
        self.pending_forks: dict[Request, list[Request]] = {}
        self.stats = SchedulerStats()
        self.fair = FairShare() if policy == "fair" else None
        self.shared_max_num_batched_tokens = min(
            shared_max_num_batched_tokens or max_num_batched_tokens, max_num_batched_tokens
        )
        self.interrupt_budget = interrupt_budget  # None: steps are never kept short for a request owed service
        self._budget = 0
        self._step = 0
        self._may_preempt = True
        self.in_flight: SchedulerOutput | None = None  # the latest step, until `complete` says it has run

    def add_request(
        self, leader: Request, followers: list[Request] | None = None, tenant_weight: float = 1.0
    ) -> None:
        """Queue a request; ``followers`` (samples 1..n-1) fork from it when its prefill completes.
        ``tenant_weight`` is the share its tenant gets under the ``fair`` policy (the latest request's wins)."""
        if self.fair is not None:
            charges = self.in_flight.charges if self.in_flight is not None else {}
            self.fair.arrive(leader, tenant_weight, self.waiting, self.running, charges)
        self.waiting.append(leader)
        if followers:
            self.pending_forks[leader] = followers

    @property
    def num_unfinished(self) -> int:
        pending = sum(len(f) for f in self.pending_forks.values())
        return len(self.waiting) + len(self.running) + len(self.swapped) + pending

    def schedule(self) -> SchedulerOutput:
        """The next step; it stays ``in_flight`` until ``complete``."""
        assert self.in_flight is None, "the step in flight has not completed"
        out = SchedulerOutput()
        self._step += 1
        owed = self._owed_waiting()
        self._budget = self._step_budget(owed)
        for request in owed:  # admitted first: the step is short for them (`_step_budget`)
            if not self._admit(out, request):
                break
        if self.fair is None:
            preempted = self._schedule_running(out, sorted(self.running, key=_class_order))
            if not preempted:
                self._schedule_swapped(out)
            if not preempted and not self.swapped:
                self._schedule_waiting(out)
        else:
            self._schedule_fair(out)
        out.block_ops = self.kv.take_block_ops()
        self.in_flight = out
        return out

    def complete(self, step: SchedulerOutput) -> None:
        """``step`` (the one in flight) has run: its charges are served."""
        assert step is self.in_flight
        self.in_flight = None

    def schedule_interrupt(self, paused: SchedulerOutput, budget: int, *, anyone: bool = False) -> SchedulerOutput:
        """A short step of at most ``budget`` tokens for the requests owed service ahead of ``paused`` (see the
        module's docstring; ``anyone``: every request outside the paused step counts as owed, a test switch).
        Empty when nobody is owed or nothing owed fits without preempting."""
        out = SchedulerOutput()
        owed = self._owed(paused, anyone)
        if not owed:
            return out
        self._budget, self._may_preempt = budget, False
        try:
            key = self.fair.key if self.fair is not None else _class_order
            self._schedule_running(out, sorted((r for r in owed if _to_compute(r) == 1), key=key))
            while self._budget > 0:
                heads: dict[str, Request] = {}  # each tenant's first waiting request, in queue order
                for request in self.waiting:
                    if request in owed:
                        heads.setdefault(tenant_of(request), request)
                prefills = [r for r in owed if r.status is RequestStatus.RUNNING and r not in out.scheduled]
                ordered = sorted([r for r in prefills if _to_compute(r) > 1] + list(heads.values()), key=key)
                if not ordered:
                    break
                request = ordered[0]
                if request.status is RequestStatus.RUNNING:
                    self._continue(out, request)
                    if request not in out.scheduled:
                        owed.remove(request)  # no block for it without preempting
                elif not self._admit(out, request):
                    break  # admissions go in order: a later one must not overtake the one that does not fit
        finally:
            self._may_preempt = True
        out.block_ops = self.kv.take_block_ops()
        return out

    def _owed(self, paused: SchedulerOutput, anyone: bool) -> list[Request]:
        """The waiting and running requests outside ``paused`` (and outside its requests' groups) owed a step."""
        groups = {r.group_id for r in paused.scheduled}
        pending = [r for r in (*self.waiting, *self.running) if r.group_id not in groups and r not in paused.scheduled]
        if anyone or not paused.scheduled:
            return pending
        return list(filter(self._owed_test(paused.scheduled), pending))

    def _owed_test(self, busy: Iterable[Request]) -> Callable[[Request], bool]:
        """Whether a request is owed service ahead of the ``busy`` requests: it is of a strictly better class than
        the worst of them, or (``fair``) of that class with its tenant at or below the interrupt floor of the other
        tenants among them."""
        busy = list(busy)
        worst = max(r.priority for r in busy)
        tenants = {tenant_of(r) for r in busy if r.priority == worst}
        fair, floors = self.fair, {}

        def owed(request: Request) -> bool:
            if request.priority < worst:
                return True
            if fair is None or request.priority > worst:
                return False
            tenant = tenant_of(request)
            if tenant not in floors:
                floors[tenant] = fair.interrupt_floor(tenants - {tenant})
            return fair.served.get(tenant, 0.0) <= floors[tenant]

        return owed

    def _owed_waiting(self) -> list[Request]:
        """With interrupts on, the waiting requests owed service ahead of the running ones, in queue order."""
        if self.interrupt_budget is None or not self.running or not self.waiting:
            return []
        return list(filter(self._owed_test(self.running), self.waiting))

    def _step_budget(self, owed: list[Request]) -> int:
        """When waiting requests are ``owed`` service ahead of the running ones, a short budget — their prompts (at
        most ``interrupt_budget``) plus a token per running request of their class or better (a worse class's
        decodes, scheduled after them, wait for the next step, as they would behind an interrupting step) — so that
        their first tokens do not wait for a long step; else the full budget, or under ``fair`` the shared one while
        two or more tenants have had work lately."""
        if owed:
            assert self.interrupt_budget is not None
            prompts = min(sum(_to_compute(r) for r in owed), self.interrupt_budget)
            worst_owed = max(r.priority for r in owed)
            decodes = sum(1 for r in self.running if r.priority <= worst_owed)
            return min(self.max_num_batched_tokens, prompts + decodes)
        if self.fair is None or self.shared_max_num_batched_tokens == self.max_num_batched_tokens:
            return self.max_num_batched_tokens
        tenants = {tenant_of(r) for queue in (self.running, self.waiting, self.swapped) for r in queue}
        shared = self.fair.note_active(tenants, self._step) >= 2
        return self.shared_max_num_batched_tokens if shared else self.max_num_batched_tokens

    def _schedule_running(self, out: SchedulerOutput, requests: list[Request]) -> bool:
        """Give each running request of ``requests``, in that order, the tokens it needs (budget permitting);
        True if a preemption happened."""
        preempted = False
        for request in requests:
            if self._budget <= 0:
                break
            if request.status is RequestStatus.RUNNING and request not in out.scheduled:
                preempted |= self._continue(out, request)
        return preempted

    def _continue(self, out: SchedulerOutput, request: Request) -> bool:
        """Schedule a running request's next tokens, preempting victims until its blocks fit (it may be its own
        victim; in an interrupting step nothing is preempted and the request is left out); True if a preemption
        happened."""
        num_new = min(request.num_tokens - request.num_computed_tokens, self._budget)
        if num_new <= 0:  # a sample forked in this very step
            return False
        preempted = False
        while not self.kv.allocate_slots(request, num_new):
            if not self._may_preempt:
                return False
            victim = self._victim()
            self._preempt(victim, out)
            preempted = True
            if victim is request:
                return preempted
        self._add(out, request, num_new)
        return preempted

    def _victim(self) -> Request:
        """The newest running request of the worst class (under ``fair``: of that class's most-served tenant)."""
        worst = max(r.priority for r in self.running)
        candidates = [r for r in self.running if r.priority == worst]
        if self.fair is None:
            return candidates[-1]
        heaviest = max(self.fair.served.get(tenant_of(r), 0.0) for r in candidates)
        return next(r for r in reversed(candidates) if self.fair.served.get(tenant_of(r), 0.0) == heaviest)

    def _schedule_fair(self, out: SchedulerOutput) -> None:
        """Decodes, then swapped requests, then prefill work (running chunks and admissions), each in fair order."""
        fair = self.fair
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        preempted = self._schedule_running(out, sorted(decodes, key=fair.key))
        if not preempted:
            self._schedule_swapped(out)
        admit = not preempted and not self.swapped
        while self._budget > 0:
            prefills = [r for r in self.running if r not in out.scheduled and r.num_tokens - r.num_computed_tokens > 1]
            heads = self._waiting_heads() if admit else []
            candidates = sorted(prefills + heads, key=fair.key)
            if not candidates:
                return
            request = candidates[0]
            if request.status is RequestStatus.RUNNING:
                if self._continue(out, request):
                    admit = False
            elif not self._admit(out, request):
                admit = False

    def _waiting_heads(self) -> list[Request]:
        """Each tenant's first waiting request whose adapter can get a slot (a preempted one requeued at the
        front comes first)."""
        heads: dict[str, Request] = {}
        for request in self.waiting:
            if self._adapter_fits(request):
                heads.setdefault(tenant_of(request), request)
        return list(heads.values())

    def _adapter_fits(self, request: Request) -> bool:
        """Whether the request runs under the base model or its adapter has or can get a slot now."""
        return request.adapter is None or self.adapters.can_acquire(request.adapter)

    def _schedule_swapped(self, out: SchedulerOutput) -> None:
        while self.swapped and len(self.running) < self.max_num_seqs:
            request = self.swapped[0]
            if not self._adapter_fits(request) or not self.kv.swap_in(request):
                return
            self.swapped.popleft()
            self._start(request)
            num_new = request.num_tokens - request.num_computed_tokens
            if num_new <= self._budget and self.kv.allocate_slots(request, num_new):
                self._add(out, request, num_new)

    def _schedule_waiting(self, out: SchedulerOutput) -> None:
        """Admit in queue order within the best class waiting, passing over requests whose adapter cannot get a
        slot now (every slot pinned by running requests of other adapters)."""
        while self.waiting and self._budget > 0:
            best = min(r.priority for r in self.waiting)
            request = next((r for r in self.waiting if r.priority == best and self._adapter_fits(r)), None)
            if request is None or not self._admit(out, request):
                return

    def _admit(self, out: SchedulerOutput, request: Request) -> bool:
        """Start a waiting request (its prefix-cache hit, then as much of its prompt as the budget allows);
        False, changing nothing, if it does not fit now (sequences, budget without chunking, or blocks)."""
        group_size = 1 + len(self.pending_forks.get(request, ()))
        if len(self.running) + group_size > self.max_num_seqs or not self._adapter_fits(request):
            return False
        prefix = self.kv.lookup_prefix(request)
        num_new = request.num_tokens - len(prefix) * self.kv.block_size
        if num_new > self._budget:
            if not self.enable_chunked_prefill:
                return False
            num_new = self._budget
        if not self.kv.allocate_slots(request, num_new, prefix):
            return False
        self.waiting.remove(request)
        if request.num_output_tokens == 0:
            request.num_cached_tokens = request.num_computed_tokens
        self.stats.prefix_cache_queries += request.num_tokens
        self.stats.prefix_cache_hits += request.num_computed_tokens
        if self.fair is not None:
            self.fair.charge_cached(request, request.num_computed_tokens)
        self._start(request)
        self._add(out, request, num_new)
        return True

    def _start(self, request: Request) -> None:
        """Running from now on; its adapter (if any) is pinned in a slot while it runs."""
        if request.adapter is not None:
            self.adapters.acquire(request.adapter)
        request.status = RequestStatus.RUNNING
        bisect.insort(self.running, request, key=_order)

    def _stop_running(self, request: Request) -> None:
        self.running.remove(request)
        if request.adapter is not None:
            self.adapters.release(request.adapter)

    def _add(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        if self.fair is not None:
            cost = self.fair.charge(request, num_new)
            tenant = tenant_of(request)
            out.charges[tenant] = out.charges.get(tenant, 0.0) + cost
        out.scheduled[request] = num_new
        self._budget -= num_new
        followers = self.pending_forks.get(request)
        if followers and request.num_computed_tokens + num_new == request.num_tokens:
            del self.pending_forks[request]
            for follower in followers:
                self.kv.fork(request, follower)
                follower.num_computed_tokens = request.num_tokens
                follower.num_charged_tokens = request.num_tokens  # the leader paid for the shared prompt
                follower.num_cached_tokens = request.num_cached_tokens
                self._start(follower)
                out.scheduled[follower] = 0
                out.sample_sources[follower] = request

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        self._stop_running(victim)
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
            self._stop_running(request)
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
