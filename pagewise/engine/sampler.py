"""Turns a step's logits into tokens: penalties, temperature, min-p / top-k / top-p, seeded draws, logprobs.

Rows are independent: a row's token depends only on its own logits, parameters, output history and generator,
so a seeded request samples the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from pagewise.engine.outputs import Logprob
from pagewise.engine.request import Request


@dataclass(slots=True)
class SampleResult:
    token_id: int
    logprobs: dict[int, Logprob] | None


class Sampler:
    def __init__(self, generator: torch.Generator, decode_token: Callable[[int], str]) -> None:
        self.generator = generator
        self.decode_token = decode_token

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[SampleResult]:
        """``logits [len(requests), vocab]`` fp32, one row per sampling request."""
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = self._apply_penalties(logits, requests)
        tokens = logits.argmax(dim=-1).tolist()
        for row, request in enumerate(requests):
            if not request.params.greedy:
                tokens[row] = self._draw(logits[row], request)
        results = []
        for row, (request, token) in enumerate(zip(requests, tokens, strict=True)):
            k = request.params.logprobs
            lp = self._logprobs(raw_logprobs[row], token, k) if k is not None else None
            results.append(SampleResult(token, lp))
        return results

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        rows = [
            i
            for i, r in enumerate(requests)
            if (r.params.presence_penalty or r.params.frequency_penalty) and r.num_output_tokens
        ]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[-1]
        for i in rows:
            params = requests[i].params
            ids = torch.tensor(requests[i].output_token_ids, device=logits.device)
            counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
            logits[i] -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
        return logits

    def _draw(self, logits: torch.Tensor, request: Request) -> int:
        params = request.params
        probs = torch.softmax(logits / params.temperature, dim=-1)
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
