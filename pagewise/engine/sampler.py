"""Turns a step's logits into tokens: logit bias, the min-tokens mask, penalties, temperature, min-p / top-k /
top-p, seeded draws, logprobs.

Rows are independent: a row's token depends only on its own logits, parameters, output history and generator,
so a seeded request samples the same tokens whatever else shares the batch. The adjustments run batched, but
element by element, so a row comes out bit-identical alone or in a batch. Sampling is batched the same way
(temperature, min-p, one ``topk`` for the rows with a top-k, one sort for those with only a top-p); only the draw
runs per row, with the row's generator over its own candidates. A row whose work raises fails alone: its result
is the exception, and the other rows are sampled as if it were not there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from pagewise import kernels
from pagewise.engine.grammar_matcher import mask_logits
from pagewise.engine.outputs import Logprob
from pagewise.engine.request import Request
from pagewise.engine.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, Logprob] | None


class Sampler:
    def __init__(
        self, generator: torch.Generator, decode_token: Callable[[int], str], eos_token_ids: Collection[int]
    ) -> None:
        self.generator = generator
        self.decode_token = decode_token
        self.eos_token_ids = list(eos_token_ids)

    @staticmethod
    def argmax_only(requests: Sequence[Request]) -> bool:
        """Whether every row's token is the argmax of its logits as they come: greedy, no grammar, logit bias,
        min-tokens mask or penalty, no log-probabilities. Such a batch may come in any float dtype."""
        return all(
            r.params.greedy
            and r.params.logprobs is None
            and r.matcher is None
            and not r.params.logit_bias
            and r.num_output_tokens >= r.params.min_tokens
            and not _has_penalty(r)
            for r in requests
        )

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult | Exception]:
        """``logits [len(requests), vocab]``, one row per sampling request, fp32 (any float dtype where
        ``argmax_only``); one result per row."""
        if self.argmax_only(requests):
            return [SampleResult(token, None) for token in kernels.argmax_rows(logits).tolist()]
        logits = logits.float()
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        results: list[SampleResult | Exception | None] = [None] * len(requests)
        try:
            logits = self._adjust(logits, requests)
        except Exception:  # noqa: BLE001 - find the row(s) at fault, one by one
            logits = logits.clone()
            for row, request in enumerate(requests):
                try:
                    logits[row] = self._adjust(logits[row : row + 1], [request])[0]
                except Exception as error:  # noqa: BLE001 - this row fails alone
                    results[row] = error
        greedy = kernels.argmax_rows(logits).tolist()
        sampled = [row for row, r in enumerate(requests) if results[row] is None and not r.params.greedy]
        drawn = dict(zip(sampled, self._sample(logits, requests, sampled), strict=True))
        for row, request in enumerate(requests):
            if results[row] is not None:
                continue
            token = drawn.get(row, greedy[row])
            if isinstance(token, Exception):
                results[row] = token
                continue
            try:
                k = request.params.logprobs
                lp = self._logprobs(raw_logprobs[row], token, k) if k is not None else None
                results[row] = SampleResult(token, lp)
            except Exception as error:  # noqa: BLE001 - this row fails alone
                results[row] = error
        return results

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> list[int | Exception]:
        """A token (or the row's error) for each of ``rows``. The candidates are found for all rows at once;
        if that raises, row by row, so a row with bad parameters fails alone. No generator is used before the
        per-row draws, so a fallback redraws nothing."""
        if not rows:
            return []
        try:
            candidates = _candidates(logits[rows], [requests[i].params for i in rows])
        except Exception as error:  # noqa: BLE001 - find the row(s) at fault, one by one
            if len(rows) == 1:
                return [error]
            return [self._sample(logits, requests, [i])[0] for i in rows]
        tokens: list[int | Exception] = []
        for row, i in zip(candidates, rows, strict=True):
            try:
                tokens.append(self._draw(row, requests[i]))
            except Exception as error:  # noqa: BLE001 - this row fails alone
                tokens.append(error)
        return tokens

    def _adjust(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        constrained = [row for row, r in enumerate(requests) if r.matcher is not None]
        if constrained:  # first: every later adjustment sees only the tokens the grammar allows
            logits = logits.clone()
            mask_logits(logits, constrained, [requests[row].matcher for row in constrained])
        return self._adjust_unconstrained(logits, requests)

    def _adjust_unconstrained(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """vLLM's order: logit bias and the min-tokens mask, then repetition, frequency and presence penalties.
        Returns ``logits`` itself when no row needs anything, else an adjusted copy."""
        bias = [i for i, r in enumerate(requests) if r.params.logit_bias]
        masked = [i for i, r in enumerate(requests) if r.num_output_tokens < r.params.min_tokens]
        penalized = [i for i, r in enumerate(requests) if _has_penalty(r)]
        if not (bias or masked or penalized):
            return logits
        logits = logits.clone()
        if bias:
            self._add_bias(logits, requests, bias)
        if masked:
            self._mask_stops(logits, requests, masked)
        if penalized:
            self._penalize(logits, requests, penalized)
        return logits

    @staticmethod
    def _add_bias(logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> None:
        entries = [(i, t, b) for i in rows for t, b in requests[i].params.logit_bias.items()]
        rows_t, ids, values = (list(column) for column in zip(*entries, strict=True))
        index = (torch.tensor(rows_t, device=logits.device), torch.tensor(ids, device=logits.device))
        logits.index_put_(index, torch.tensor(values, dtype=logits.dtype, device=logits.device), accumulate=True)

    def _mask_stops(self, logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> None:
        """Before ``min_tokens`` outputs, EOS (unless ignored) and the stop token ids cannot be sampled."""
        cells = []
        for i in rows:
            params = requests[i].params
            stops = set(params.stop_token_ids or ())
            if not params.ignore_eos:
                stops.update(self.eos_token_ids)
            cells += [(i, t) for t in stops]
        if cells:
            index = torch.tensor(cells, device=logits.device).T
            logits[index[0], index[1]] = float("-inf")

    @staticmethod
    def _penalize(logits: torch.Tensor, requests: Sequence[Request], rows: list[int]) -> None:
        """vLLM's penalties: repetition over prompt + output (divide positive logits, multiply negative ones),
        then ``logit -= frequency * count + presence * (count > 0)`` over the output (OpenAI's definition)."""
        dev, vocab = logits.device, logits.shape[-1]
        sub = logits[rows]
        counts = torch.zeros_like(sub)
        outputs = [requests[i].output_token_ids for i in rows]  # a slice each: taken once per row
        out_rows = [r for r, ids in enumerate(outputs) for _ in ids]
        out_ids = [t for ids in outputs for t in ids]
        if out_ids:
            counts.index_put_(
                (torch.tensor(out_rows, device=dev), torch.tensor(out_ids, device=dev)),
                torch.ones(len(out_ids), dtype=sub.dtype, device=dev),
                accumulate=True,
            )
        seen = counts > 0
        params = [requests[i].params for i in rows]
        repetition = [p.repetition_penalty for p in params]
        if any(r != 1.0 for r in repetition):
            in_prompt = torch.zeros((len(rows), vocab), dtype=torch.bool, device=dev)
            prompts = [requests[i].prompt_token_ids for i in rows]
            prompt_rows = [r for r, ids in enumerate(prompts) for _ in ids]
            prompt_ids = [t for ids in prompts for t in ids]
            in_prompt[torch.tensor(prompt_rows, device=dev), torch.tensor(prompt_ids, device=dev)] = True
            penalty = torch.tensor(repetition, dtype=sub.dtype, device=dev)[:, None].expand_as(sub)
            penalty = torch.where(in_prompt | seen, penalty, torch.ones_like(penalty))
            sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        logits[rows] = sub - frequency * counts - presence * seen

    def _draw(self, candidates: Candidates, request: Request) -> int:
        """The exponential race ``argmax(probs / Exp(1))`` over one row's candidates, with the row's own generator
        (the sampler's when unseeded): noise of the row's own length, so the draw ignores the rest of the batch."""
        generator = request.generator or self.generator
        noise = torch.empty_like(candidates.probs).exponential_(generator=generator)
        winner = int((candidates.probs / noise).argmax())
        return winner if candidates.token_ids is None else int(candidates.token_ids[winner])

    def _logprobs(self, logprobs: torch.Tensor, token: int, k: int) -> dict[int, Logprob]:
        chosen = float(logprobs[token])
        rank = int((logprobs > chosen).sum()) + 1
        result = {token: Logprob(chosen, rank, self.decode_token(token))}
        if k:
            values, ids = logprobs.topk(k)
            for r, (value, tid) in enumerate(zip(values.tolist(), ids.tolist(), strict=True), start=1):
                result.setdefault(tid, Logprob(value, r, self.decode_token(tid)))
        return result


def _has_penalty(request: Request) -> bool:
    params = request.params
    if params.repetition_penalty != 1.0:
        return True
    return bool(params.presence_penalty or params.frequency_penalty) and request.num_output_tokens > 0


@dataclass(slots=True)
class Candidates:
    """One row's candidate tokens after temperature, min-p, top-k and top-p: ``probs`` (cut ones are 0) over the
    whole vocabulary when ``token_ids`` is None, else over ``token_ids``, sorted by probability, highest first."""

    probs: torch.Tensor
    token_ids: torch.Tensor | None


def _candidates(logits: torch.Tensor, params: Sequence[SamplingParams]) -> list[Candidates]:
    """Temperature and min-p over all rows at once; then one ``topk`` with the largest k over the rows with a
    top-k, one sort over the rows with only a top-p. Each row's result is the same alone or in any batch: every
    step is element by element or within the row, and candidate lists are cut at the row's own k."""
    dev = logits.device
    # A reciprocal multiplied in, not a division: torch divides by a one-element tensor differently.
    inverse = torch.tensor([1.0 / p.temperature for p in params], dtype=logits.dtype, device=dev)[:, None]
    # nan_to_num: extreme (valid) penalties can overflow fp32 to inf, which softmax would turn into NaN.
    probs = torch.softmax(torch.nan_to_num(logits * inverse), dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=dev)[:, None]
        probs = probs.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
    vocab = probs.shape[-1]
    result: list[Candidates | None] = [None] * len(params)
    top_k = [i for i, p in enumerate(params) if p.top_k > 0]
    top_p = [i for i, p in enumerate(params) if p.top_k <= 0 and p.top_p < 1]
    for i, p in enumerate(params):
        if p.top_k <= 0 and p.top_p >= 1:  # the whole vocabulary
            result[i] = Candidates(probs[i], None)
    if top_k:
        lengths = [min(params[i].top_k, vocab) for i in top_k]
        values, ids = _top(probs[top_k], lengths)
        _cut_top_p(values, [params[i].top_p for i in top_k])
        for row, (i, n) in enumerate(zip(top_k, lengths, strict=True)):
            result[i] = Candidates(values[row, :n], ids[row, :n])
    if top_p:
        values, ids = probs[top_p].sort(dim=-1, descending=True, stable=True)
        _cut_top_p(values, [params[i].top_p for i in top_p])
        for row, i in enumerate(top_p):
            result[i] = Candidates(values[row], ids[row])
    return result


def _top(probs: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The highest ``lengths[row]`` probabilities of each row and their ids, highest first; 0 past a row's length.
    ``topk`` orders ties arbitrarily (and by its k), so a row with a tie among its positive values, the first
    one past its length included, is redone on its own (``_top_with_ties``: ties by id, what a stable sort of the
    whole row gives): its candidates then depend on nothing else in the batch."""
    dev, vocab = probs.device, probs.shape[-1]
    width = min(max(lengths) + 1, vocab)  # one past the longest, to see a tie at a row's cut
    values, ids = probs.topk(width, dim=-1)
    position = torch.arange(width, device=dev)
    length = torch.tensor(lengths, device=dev)[:, None]
    tied = (values[:, 1:] == values[:, :-1]) & (values[:, 1:] > 0) & (position[1:] <= length)
    for row in tied.any(dim=-1).nonzero().flatten().tolist():
        n = lengths[row]
        values[row, :n], ids[row, :n] = _top_with_ties(probs[row], values[row, n - 1], n)
    return values.masked_fill(position >= length, 0.0), ids


def _top_with_ties(row: torch.Tensor, cut: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` of ``row`` sorted stably by value, highest first (ties by id), given ``cut``, the n-th
    highest value: every value above it, then the lowest ids of those equal to it, ordered — one pass over the
    row and a sort of ``n`` values, not a sort of the whole row (a tied row costs about as much as an untied
    one)."""
    above = (row > cut).nonzero().flatten()
    level = (row == cut).nonzero().flatten()[: n - above.numel()]
    ids = torch.cat((above, level)).sort().values  # by id, so the stable sort below breaks ties by id
    values, order = row[ids].sort(descending=True, stable=True)
    return values, ids[order]


def _cut_top_p(values: torch.Tensor, top_p: list[float]) -> None:
    """In place over ``values`` (each row sorted, highest first, 0 past its candidates): keeps the smallest
    prefix whose mass reaches ``top_p`` of the row's mass (renormalized over the candidates) and the first."""
    if all(p >= 1 for p in top_p):
        return
    cumulative = values.cumsum(dim=-1)
    total = cumulative[:, -1:]  # trailing zeros add nothing: the same whatever the width
    p = torch.tensor(top_p, dtype=values.dtype, device=values.device)[:, None]
    threshold = torch.where(p < 1, p * total, torch.full_like(total, float("inf")))
    keep = cumulative - values < threshold
    keep[:, 0] = True
    values.mul_(keep)
