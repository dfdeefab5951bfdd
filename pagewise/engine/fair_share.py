"""Tenant fair share: a virtual token counter per tenant (Sheng et al., "Fairness in Serving Large Language
Models", OSDI 2024), which the ``fair`` scheduling policy reads to decide who goes next.

Invariants:
- ``served[t]`` grows by the cost of the work the engine schedules for tenant ``t``, divided by its weight: each
  prompt position computed costs ``PROMPT_COST``, each position served from the prefix cache ``CACHED_COST`` (a hit
  skips the projections and the MLP; it still holds KV blocks and is read by attention), each decode step (one new
  token) ``OUTPUT_COST``. A position is charged once: a recompute after preemption is the engine's choice, not the
  tenant's, so ``Request.num_charged_tokens`` (a high-water mark) keeps it from being charged again.
- A tenant becoming backlogged (a request arrives while none of its requests waits) is lifted to the least counter
  among the tenants that are backlogged (or, if none is, running), so time spent idle or asking for less than its
  share is never banked into a burst that would starve the others; a tenant alone takes the whole engine (the
  policy is work-conserving: counters only order the work, they never idle the engine). The counters it is lifted
  to leave out what the step in flight charged (work scheduled, not yet served: VTC counts tokens as they are
  served), and it lands ``INTERRUPT_THRESHOLD`` below the least of them: a tenant that just became backlogged is
  owed service ahead of the others (``interrupt_floor``) — ahead of a long step in flight, by about its cost too —
  which lets its first request cut in; the head start is at most ``INTERRUPT_THRESHOLD`` per backlog.
- Over any interval in which two tenants stay backlogged, their counters differ by at most what the requests one
  of them already runs can still cost, plus one step's charge (``test_fair_share`` states and checks the bound).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pagewise.engine.request import Request

INTERRUPT_THRESHOLD = 64.0  # how far (weighted tokens) below the other tenants a tenant must be to be owed service
RECENT_STEPS = 32  # a tenant that had work within this many steps counts as sharing the engine
PROMPT_COST = 1.0
CACHED_COST = 0.1
OUTPUT_COST = 2.0  # the paper's default weight of an output token relative to an input token
_NO_TENANT = ""


def tenant_of(request: Request) -> str:
    return request.tenant_id or _NO_TENANT


@dataclass(slots=True)
class FairShare:
    """Per-tenant counters and weights."""

    served: dict[str, float] = field(default_factory=dict)
    weights: dict[str, float] = field(default_factory=dict)
    last_active: dict[str, int] = field(default_factory=dict)  # tenant -> the latest step it had work at

    def note_active(self, tenants: Iterable[str], step: int) -> int:
        """Record that ``tenants`` have work at ``step``; return how many tenants had work within the last
        ``RECENT_STEPS`` steps (those earlier are forgotten)."""
        for tenant in tenants:
            self.last_active[tenant] = step
        horizon = step - RECENT_STEPS
        for tenant in [t for t, s in self.last_active.items() if s <= horizon]:
            del self.last_active[tenant]
        return len(self.last_active)

    def key(self, request: Request) -> tuple[int, float, int, int]:
        """Scheduling order: the better priority class first, then the least-served tenant, then arrival order
        within and across tenants."""
        served = self.served.get(tenant_of(request), 0.0)
        return request.priority, served, request.arrival_seq, request.sample_index

    def arrive(
        self,
        request: Request,
        weight: float,
        waiting: Iterable[Request],
        running: Iterable[Request],
        in_flight: Mapping[str, float],
    ) -> None:
        """``request`` is about to join ``waiting``; lift its tenant's counter if that tenant had none waiting.
        ``in_flight``: what the step in flight charged each tenant."""
        tenant = tenant_of(request)
        self.weights[tenant] = weight
        backlogged = {tenant_of(r) for r in waiting}
        if tenant in backlogged:
            return
        others = (backlogged or {tenant_of(r) for r in running}) - {tenant}
        if others:
            lifted = min(self.served.get(t, 0.0) - in_flight.get(t, 0.0) for t in others) - INTERRUPT_THRESHOLD
            self.served[tenant] = max(self.served.get(tenant, 0.0), lifted)

    def interrupt_floor(self, tenants: Iterable[str]) -> float:
        """A tenant with a counter at or below this is owed service ahead of ``tenants``' work (the other tenants
        in a step); -inf when there are none."""
        return min((self.served.get(t, 0.0) for t in tenants), default=-math.inf) - INTERRUPT_THRESHOLD

    def charge_cached(self, request: Request, num_cached: int) -> None:
        """A prefix hit of ``num_cached`` positions at admission (charged once per request)."""
        new = num_cached - request.num_charged_tokens
        if new > 0:
            request.num_charged_tokens = num_cached
            self._add(request, new * CACHED_COST)

    def charge(self, request: Request, num_new: int) -> float:
        """``num_new`` positions from ``request.num_computed_tokens`` on are scheduled this step; returns what its
        tenant's counter grew by."""
        start = max(request.num_computed_tokens, request.num_charged_tokens)
        end = request.num_computed_tokens + num_new
        if end <= start:
            return 0.0
        request.num_charged_tokens = end
        prompt = max(0, min(end, request.num_prompt_tokens) - start)
        sampled = end == request.num_tokens  # the step that computes the last known position samples a token
        return self._add(request, prompt * PROMPT_COST + (OUTPUT_COST if sampled else 0.0))

    def _add(self, request: Request, cost: float) -> float:
        tenant = tenant_of(request)
        weighted = cost / self.weights.get(tenant, 1.0)
        self.served[tenant] = self.served.get(tenant, 0.0) + weighted
        return weighted

    def snapshot(self, waiting: Iterable[Request], running: Iterable[Request]) -> dict[str, dict[str, float | int]]:
        """Per active tenant: its counter, weight, and running / waiting sequences (for stats and metrics)."""
        num_running = Counter(tenant_of(r) for r in running)
        num_waiting = Counter(tenant_of(r) for r in waiting)
        return {
            t: {
                "served": self.served.get(t, 0.0),
                "weight": self.weights.get(t, 1.0),
                "running": num_running[t],
                "waiting": num_waiting[t],
            }
            for t in sorted(set(num_running) | set(num_waiting))
        }
