"""The fair scheduling policy, through the real scheduler and KV cache manager (the model is simulated: a
scheduled prefill or decode just computes its tokens, as in `test_scheduler_properties.py`).

- Bound: while two tenants stay backlogged (each has a request waiting), their weighted served tokens never differ
  by more than `U = max_num_seqs x C + max_num_batched_tokens x OUTPUT_COST`, C being the largest cost of one
  request (prompt x PROMPT_COST + max_tokens x OUTPUT_COST): a tenant ahead gets no new admission while the other
  waits, but its running requests finish what they started, and one step may charge a full budget.
- No banking: a tenant idle while another ran is lifted to just below the other's counter (by
  `INTERRUPT_THRESHOLD`) when it arrives, so it does not get the engine to itself until it "catches up".
- Weights: a tenant of weight 2 is served twice the tokens of a tenant of weight 1 while both are backlogged.
- FCFS is unchanged, and a tenant alone gets every step's full budget (work-conserving); while two tenants
  share, steps keep to the shared budget.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagewise.engine.block_pool import BlockPool
from pagewise.engine.fair_share import OUTPUT_COST, PROMPT_COST, RECENT_STEPS
from pagewise.engine.kv_cache_manager import KVCacheManager
from pagewise.engine.request import Request
from pagewise.engine.sampling_params import SamplingParams
from pagewise.engine.scheduler import Scheduler

BS = 4


class Sim:
    """A scheduler over a real block pool, stepped with simulated compute; counts raw tokens served per tenant."""

    def __init__(
        self,
        *,
        num_blocks: int = 400,
        budget: int = 32,
        max_num_seqs: int = 8,
        policy: str = "fair",
        shared_budget: int | None = None,
    ):
        self.pool = BlockPool(num_blocks, enable_caching=False)
        self.kv = KVCacheManager(self.pool, BS, num_swap_slots=0)
        self.scheduler = Scheduler(self.kv, max_num_seqs, budget, True, "recompute", policy, shared_budget)
        self.served: Counter[str] = Counter()
        self.arrivals = 0
        self.rng = random.Random(0)

    def submit(self, tenant: str, prompt_len: int, max_tokens: int, weight: float = 1.0) -> Request:
        request = Request(
            f"r{self.arrivals}",
            [self.rng.randrange(3, 50) for _ in range(prompt_len)],
            SamplingParams(max_tokens=max_tokens),
            self.arrivals,
            tenant,
        )
        self.arrivals += 1
        self.scheduler.add_request(request, tenant_weight=weight)
        return request

    def step(self) -> dict[Request, int]:
        out = self.scheduler.schedule()
        self.scheduler.complete(out)
        for request, num_new in out.scheduled.items():
            request.num_computed_tokens += num_new
            self.served[request.tenant_id] += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(7)
                if request.num_output_tokens >= request.params.max_tokens:
                    self.scheduler.finish(request)
        return out.scheduled

    def backlog(self, tenant: str) -> int:
        """The tenant's unfinished requests."""
        s = self.scheduler
        return sum(1 for r in [*s.waiting, *s.running] if r.tenant_id == tenant)

    def waiting(self, tenant: str) -> int:
        return sum(1 for r in self.scheduler.waiting if r.tenant_id == tenant)

    def counter(self, tenant: str) -> float:
        return self.scheduler.fair.served.get(tenant, 0.0)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31), budget=st.sampled_from([8, 16, 32]), max_num_seqs=st.integers(2, 8))
def test_two_backlogged_tenants_stay_within_the_bound(seed: int, budget: int, max_num_seqs: int) -> None:
    rng = random.Random(seed)
    sim = Sim(budget=budget, max_num_seqs=max_num_seqs)
    longest_prompt, longest_output = 40, 12
    bound = max_num_seqs * (longest_prompt * PROMPT_COST + longest_output * OUTPUT_COST) + budget * OUTPUT_COST
    checked = 0
    for _ in range(600):
        for tenant, rate in (("heavy", 0.9), ("light", 0.3)):  # both keep a backlog, at different sizes
            if rng.random() < rate and sim.backlog(tenant) < 12:
                sim.submit(tenant, rng.randint(1, longest_prompt), rng.randint(1, longest_output))
        sim.step()
        if sim.waiting("heavy") and sim.waiting("light"):
            checked += 1
            assert abs(sim.counter("heavy") - sim.counter("light")) <= bound
    assert checked >= 20  # the interval of interest really happened


def test_an_idle_tenant_banks_nothing() -> None:
    sim = Sim(budget=16, max_num_seqs=16)
    for _ in range(40):
        sim.submit("early", 24, 8)
    for _ in range(60):  # "early" alone: every token is its own
        sim.step()
    assert sim.served["late"] == 0 and sim.counter("early") > 500
    for _ in range(40):
        sim.submit("late", 24, 8)
    sim.served.clear()
    for _ in range(30):
        sim.step()
        assert sim.counter("late") >= sim.counter("early") - 2 * 16 * OUTPUT_COST * 16  # lifted, not from zero
    # "late" gets no burst that starves "early": both are served within a factor of 2 of each other
    assert 0.5 <= sim.served["late"] / sim.served["early"] <= 2.0


def test_weights_share_the_engine_in_proportion() -> None:
    sim = Sim(budget=16, max_num_seqs=4)
    for _ in range(200):
        sim.submit("gold", 16, 4, weight=2.0)
        sim.submit("basic", 16, 4, weight=1.0)
    for _ in range(150):
        sim.step()
    assert sim.backlog("gold") and sim.backlog("basic")
    assert 1.6 <= sim.served["gold"] / sim.served["basic"] <= 2.5


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_tenant_alone_gets_the_full_budget(policy: str) -> None:
    sim = Sim(budget=16, max_num_seqs=8, policy=policy)
    for _ in range(20):
        sim.submit("solo", 30, 4)
    for _ in range(10):
        assert sum(sim.step().values()) == 16


def test_the_shared_budget_holds_while_a_second_tenant_was_active_lately() -> None:
    """A flood alone gets the full budget; from the step a second tenant has work, and for RECENT_STEPS steps
    after its last work, every step is at most the shared budget; then the full budget comes back."""
    sim = Sim(budget=32, max_num_seqs=32, shared_budget=12)
    for _ in range(40):
        sim.submit("flood", 120, 8)
    assert [sum(sim.step().values()) for _ in range(5)] == [32] * 5
    quiet = sim.submit("quiet", 8, 1)
    first = sim.step()
    assert first[quiet] == 8 and sum(first.values()) == 12  # the quiet prompt first, inside the shared budget
    assert sim.backlog("quiet") == 0
    shared = [sum(sim.step().values()) for _ in range(RECENT_STEPS - 1)]  # the steps within RECENT_STEPS of it
    assert shared == [12] * (RECENT_STEPS - 1)
    assert sum(sim.step().values()) == 32  # the quiet tenant's last work is RECENT_STEPS steps ago


def test_a_waiting_quiet_tenant_goes_before_a_flood_of_prefills() -> None:
    """The quiet tenant's new request is admitted at the next step, ahead of the flood's prompt chunks."""
    sim = Sim(budget=32, max_num_seqs=32)
    for _ in range(20):
        sim.submit("flood", 120, 8)
    for _ in range(5):
        sim.step()
    quiet = sim.submit("quiet", 8, 2)
    scheduled = sim.step()
    assert scheduled.get(quiet) == 8
    fcfs = Sim(budget=32, max_num_seqs=32, policy="fcfs")
    for _ in range(20):
        fcfs.submit("flood", 120, 8)
    for _ in range(5):
        fcfs.step()
    late = fcfs.submit("quiet", 8, 2)
    assert late not in fcfs.step()  # FCFS: behind every earlier prompt


def test_preemption_takes_the_most_served_tenants_newest_request() -> None:
    sim = Sim(num_blocks=24, budget=64, max_num_seqs=8)
    heavy = [sim.submit("heavy", 16, 40) for _ in range(3)]
    light = sim.submit("light", 16, 40)
    preempted = []
    for _ in range(40):
        out = sim.scheduler.schedule()
        sim.scheduler.complete(out)
        preempted += [r.tenant_id for r in out.preempted]
        for request, num_new in out.scheduled.items():
            request.num_computed_tokens += num_new
            if request.num_computed_tokens == request.num_tokens:
                request.append_token(7)
    assert preempted and set(preempted) == {"heavy"}, preempted
    assert light.num_output_tokens > 0 and heavy
