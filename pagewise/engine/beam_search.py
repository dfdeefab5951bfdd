"""Beam search on top of the engine, the way vLLM v1 does it: outside the engine core, one engine request per
live beam per step, with KV reuse through the prefix cache.

Each step submits every live beam of every prompt as an ordinary request — prompt = the beam's full token ids
(prompt + generated so far), ``SamplingParams(max_tokens=1, temperature=0, logprobs=M, ignore_eos=True)``, the
caller's ``tenant_id`` — and steps the engine until all of them are finished. The top-``M`` raw log-probabilities
of each request's one sampled position (``M = max(2, 1 + number of EOS ids) * beam_width``, ``2 * beam_width``
for a single EOS id or with ``ignore_eos``) are combined with the beam's cumulative log-probability, and the
candidates are selected exactly as HF transformers' ``_beam_search`` selects them (see ``_PromptSearch.advance``).

KV reuse and memory. Prefix caching is on by default; each request registers the full blocks of its prompt
when they are computed, and a finished request's blocks go back to the free queue still hashed. A child beam's
prompt is its parent's prompt plus one token, so at admission it hits every full block its parent computed (ref
count up, nothing recomputed) and only the last, partial block — at most ``block_size`` tokens — is computed
again. Beams that share a prefix in the same step hit the same cached blocks, so the invariant is: **the KV of a
shared beam prefix exists once per full block**, however many beams share it. A dropped beam simply has no
child request: its blocks were freed when its request finished and stay hittable until allocation evicts them
(LRU, tail blocks first). Nothing is held between steps, so after ``beam_search`` returns every block is free.
With ``enable_prefix_caching=False`` the answer is the same, but every step recomputes every beam's full context.

Semantics matched (transformers 5.24, ``GenerationMixin._beam_search``, ``do_sample=False``, batch of one):

- Candidates: the top ``M`` of ``cum_logprob(beam) + logprob(token)`` over all live beams × the vocabulary,
  best first (fp32 sums, as HF). The first step has one live beam (the prompt), as HF's initial scores
  ``[0, -1e9, ...]`` make it.
- A candidate "hits a stopping criterion" when its token is an EOS id (unless ``ignore_eos``) or when it
  reaches ``max_tokens`` generated tokens (every candidate in the last step).
- Finished hypotheses: only hitting candidates among the first ``beam_width`` ranks are added, with
  ``score = cum_logprob / generated_len ** length_penalty`` where ``generated_len`` counts the new tokens
  including the final one (the EOS token when it ends on EOS). The finished set keeps the best ``beam_width``;
  with ``early_stopping=True`` nothing is added once it is full.
- Next live beams: the best ``beam_width`` non-hitting candidates, in rank order.
- Stop when (after a step) the finished set is full and the best live beam cannot beat its worst member —
  ``best_cum / L ** length_penalty <= worst_score`` with ``L`` = tokens generated so far, or ``L = max_tokens``
  when ``early_stopping == "never"`` and ``length_penalty > 0`` — or, with ``early_stopping=True``, as soon as the
  finished set is full, or when every candidate hit a stopping criterion (``max_tokens``).
- Result: the finished hypotheses sorted by score, best first (``num_return_sequences = beam_width``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.llm_engine import LLMEngine, PromptInput
from pagewise.engine.sampling_params import _MAX_LOGPROBS, SamplingParams, is_int


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search parameters, validated on construction (HF transformers' names and meanings).

    - ``beam_width``: beams kept per step, and sequences returned per prompt.
    - ``max_tokens``: most new tokens per sequence (HF ``max_new_tokens``), capped by ``max_model_len``.
    - ``ignore_eos``: EOS is an ordinary token (no hypothesis finishes before ``max_tokens``).
    - ``temperature``: must be 0 — beam search here is deterministic (HF ``do_sample=False``).
    - ``length_penalty``: finished score = ``cum_logprob / generated_len ** length_penalty``; > 0 favours longer
      sequences, < 0 shorter ones.
    - ``early_stopping``: ``True`` stops as soon as ``beam_width`` hypotheses are finished; ``False`` stops when a
      heuristic says no live beam can do better; ``"never"`` stops only when no live beam can do better (the
      canonical algorithm).
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidRequestError(message)

        if not is_int(self.beam_width) or not 1 <= self.beam_width <= _MAX_LOGPROBS // 2:
            fail(f"beam_width must be an integer in [1, {_MAX_LOGPROBS // 2}], got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.ignore_eos, bool):
            fail(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if not isinstance(self.temperature, int | float) or self.temperature != 0:
            fail(f"temperature must be 0 (beam search is deterministic; beam sampling is not supported), "
                 f"got {self.temperature!r}")
        if (
            not isinstance(self.length_penalty, int | float)
            or isinstance(self.length_penalty, bool)
            or not math.isfinite(self.length_penalty)
        ):
            fail(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            fail(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass(slots=True)
class BeamSearchSequence:
    """One finished hypothesis: the generated ``token_ids`` (ending with the EOS token when it finished on
    one), their ``text``, the sum of their log-probabilities and the length-penalised ``score`` it is ranked by."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (ended on EOS) or "length"


@dataclass(slots=True)
class BeamSearchOutput:
    """The result for one prompt: ``sequences`` best first (``beam_width`` of them)."""

    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    prompt: str | None = None


@dataclass(slots=True)
class _Beam:
    token_ids: list[int]  # generated so far
    cum_logprob: float  # an fp32 value: HF accumulates in fp32


@dataclass(slots=True)
class _Hypothesis:
    token_ids: list[int]
    cum_logprob: float
    score: float  # an fp32 value, as HF computes it
    ends_on_eos: bool


def _f32(value: float) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32)


@dataclass(slots=True, eq=False)
class _PromptSearch:
    """The beam-search state of one prompt (one HF batch item)."""

    prompt_token_ids: list[int]
    prompt: str | None
    params: BeamSearchParams
    max_tokens: int
    eos_ids: frozenset[int]
    num_candidates: int
    beams: list[_Beam] = field(default_factory=lambda: [_Beam([], 0.0)])
    finished: list[_Hypothesis] = field(default_factory=list)
    done: bool = False

    def advance(self, step_logprobs: list[dict[int, float]]) -> None:
        """One HF ``_beam_search`` loop iteration, given each live beam's top-M next-token log-probabilities."""
        p = self.params
        k = p.beam_width
        cur = len(self.beams[0].token_ids) + 1  # tokens generated once this step's token is appended
        # c. The top M of cum + logprob over beams x vocab, summed in fp32. Each beam's own top M holds every
        # global top-M candidate of that beam. Ties (which random fp32 weights do not produce) go to the lower
        # beam index, then the lower token id.
        scored: list[tuple[float, int, int]] = []
        for b, (beam, logprobs) in enumerate(zip(self.beams, step_logprobs, strict=True)):
            ids = sorted(logprobs)
            sums = _f32(beam.cum_logprob) + torch.tensor([logprobs[t] for t in ids], dtype=torch.float32)
            scored.extend(zip(sums.tolist(), itertools.repeat(b), ids))
        scored.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = scored[: self.num_candidates]
        # d. which candidates hit a stopping criterion: an EOS id, or max length (all of them in the last step)
        at_max = cur >= self.max_tokens
        hits = [at_max or t in self.eos_ids for _, _, t in candidates]
        # f. (before e, which replaces the beams) finished hypotheses: hitting candidates among the first k
        # ranks, scored with the length penalty; the best k are kept. With early_stopping=True a full set is
        # closed (HF then stops, see g).
        if not (len(self.finished) == k and p.early_stopping is True):
            penalty = cur**p.length_penalty
            for (cum, b, t), hit in itertools.islice(zip(candidates, hits, strict=True), k):
                if hit:
                    score = (_f32(cum) / penalty).item()
                    self.finished.append(_Hypothesis(self.beams[b].token_ids + [t], cum, score, t in self.eos_ids))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties, as in HF's topk
            del self.finished[k:]
        # e. the next live beams: the best k candidates that did not hit
        self.beams = [
            _Beam(self.beams[b].token_ids + [t], cum) for (cum, b, t), hit in zip(candidates, hits, strict=True)
            if not hit
        ][:k]
        # g. stopping the whole search
        full = len(self.finished) == k
        if not self.beams or (full and p.early_stopping is True):
            self.done = True
        elif full:
            length = self.max_tokens if (p.early_stopping == "never" and p.length_penalty > 0) else cur
            best_possible = (_f32(self.beams[0].cum_logprob) / length**p.length_penalty).item()
            self.done = not best_possible > self.finished[-1].score


def _extend_beams(
    engine: LLMEngine,
    live: list[_PromptSearch],
    probe: SamplingParams,
    tenant_id: str | None,
    new_request_id: Callable[[], str],
) -> None:
    """One round: every live beam of every search one token further (one engine request each, run together)."""
    requests: list[tuple[_PromptSearch, str]] = []
    try:
        for search in live:
            for beam in search.beams:
                request_id = new_request_id()
                engine.add_request(request_id, search.prompt_token_ids + beam.token_ids, probe, tenant_id)
                requests.append((search, request_id))
        results = _run_to_completion(engine, {request_id for _, request_id in requests})
    finally:
        for _, request_id in requests:
            engine.abort_request(request_id)  # no-op for finished requests
    per_search: dict[_PromptSearch, list[dict[int, float]]] = {s: [] for s in live}
    for search, request_id in requests:
        (logprobs,) = results[request_id]
        per_search[search].append(logprobs)
    for search in live:
        search.advance(per_search[search])


def beam_search(
    engine: LLMEngine,
    prompts: Sequence[PromptInput],
    params: BeamSearchParams,
    tenant_id: str | None,
    new_request_id: Callable[[], str],
) -> list[BeamSearchOutput]:
    """Run beam search for every prompt (batched: each engine step serves every live beam of every prompt).
    Everything is validated before the first request is queued, so an error leaves the engine untouched."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(f"params must be a BeamSearchParams, got {type(params).__name__}")
    eos_ids = frozenset() if params.ignore_eos else frozenset(engine.eos_token_ids)
    num_candidates = max(2, 1 + len(eos_ids)) * params.beam_width
    if num_candidates > _MAX_LOGPROBS:
        raise InvalidRequestError(
            f"beam_width={params.beam_width} needs the top {num_candidates} log-probabilities per step with "
            f"{len(eos_ids)} EOS ids; at most {_MAX_LOGPROBS} are available"
        )
    probe = SamplingParams(max_tokens=1, temperature=0, logprobs=num_candidates, ignore_eos=True)
    searches = []
    for prompt in prompts:
        token_ids = engine.process_prompt(prompt, probe)
        max_tokens = min(params.max_tokens, engine.max_model_len - len(token_ids))
        searches.append(
            _PromptSearch(
                token_ids,
                prompt if isinstance(prompt, str) else None,
                params,
                max_tokens,
                eos_ids,
                num_candidates,
            )
        )
    live = [s for s in searches if not s.done]
    while live:
        _extend_beams(engine, live, probe, tenant_id, new_request_id)
        live = [s for s in live if not s.done]
    decode = engine.tokenizer.decode
    return [
        BeamSearchOutput(
            s.prompt_token_ids,
            [
                BeamSearchSequence(
                    h.token_ids,
                    decode(h.token_ids, skip_special_tokens=True),
                    h.cum_logprob,
                    float(h.score),
                    "stop" if h.ends_on_eos else "length",
                )
                for h in s.finished
            ],
            s.prompt,
        )
        for s in searches
    ]


def _run_to_completion(engine: LLMEngine, request_ids: set[str]) -> dict[str, list[dict[int, float]]]:
    """Step the engine until every request in ``request_ids`` finished; each one's per-position logprobs."""
    results: dict[str, list[dict[int, float]]] = {}
    while len(results) < len(request_ids):
        if not engine.has_unfinished_requests():
            raise RuntimeError("engine stopped with beam requests unfinished")
        for output in engine.step():
            if output.error is not None and output.request_id in request_ids:
                raise output.error
            if output.finished and output.request_id in request_ids:
                logprobs = output.outputs[0].logprobs or []
                results[output.request_id] = [{t: lp.logprob for t, lp in pos.items()} for pos in logprobs]
    return results
