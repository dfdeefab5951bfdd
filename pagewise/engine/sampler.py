"""Turns a step's logits into tokens: logit bias, the min-tokens mask, penalties, temperature, min-p / top-k /
top-p, seeded draws, logprobs.

Rows are independent: a row's token depends only on its own logits, parameters, output history and generator,
so a seeded request samples the same tokens whatever else shares the batch. The adjustments run batched, but
element by element, so a row comes out bit-identical alone or in a batch. A row whose work raises fails alone:
its result is the exception, and the other rows are sampled as if it were not there.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch

from pagewise.engine.outputs import Logprob
from pagewise.engine.request import Request


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

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult | Exception]:
        """``logits [len(requests), vocab]`` fp32, one row per sampling request; one result per row."""
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
        greedy = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            if results[row] is not None:
                continue
            try:
                token = greedy[row] if request.params.greedy else self._draw(logits[row], request)
                k = request.params.logprobs
                lp = self._logprobs(raw_logprobs[row], token, k) if k is not None else None
                results[row] = SampleResult(token, lp)
            except Exception as error:  # noqa: BLE001 - this row fails alone
                results[row] = error
        return results

    def _adjust(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
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
        out_rows = [r for r, i in enumerate(rows) for _ in requests[i].output_token_ids]
        out_ids = [t for i in rows for t in requests[i].output_token_ids]
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
            prompt_rows = [r for r, i in enumerate(rows) for _ in requests[i].prompt_token_ids]
            prompt_ids = [t for i in rows for t in requests[i].prompt_token_ids]
            in_prompt[torch.tensor(prompt_rows, device=dev), torch.tensor(prompt_ids, device=dev)] = True
            penalty = torch.tensor(repetition, dtype=sub.dtype, device=dev)[:, None].expand_as(sub)
            penalty = torch.where(in_prompt | seen, penalty, torch.ones_like(penalty))
            sub = torch.where(sub > 0, sub / penalty, sub * penalty)
        frequency = torch.tensor([p.frequency_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], dtype=sub.dtype, device=dev)[:, None]
        logits[rows] = sub - frequency * counts - presence * seen

    def _draw(self, logits: torch.Tensor, request: Request) -> int:
        params = request.params
        # nan_to_num: extreme (valid) penalties can overflow fp32 to inf, which softmax would turn into NaN.
        probs = torch.softmax(torch.nan_to_num(logits / params.temperature), dim=-1)
        if params.min_p > 0:
            probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
        if params.top_k > 0 or params.top_p < 1:
            sorted_probs, order = probs.sort(descending=True)
            keep = torch.ones_like(sorted_probs, dtype=torch.bool)
            if params.top_k > 0:
                keep[params.top_k :] = False
            if params.top_p < 1:
                before = sorted_probs.cumsum(0) - sorted_probs
                keep &= before < params.top_p * sorted_probs.sum()
            keep[0] = True
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs * keep)
        generator = request.generator or self.generator
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return int((probs / noise).argmax())

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
