"""The engine's side of structured outputs (`structured_outputs.py` has the parameters): one llguidance matcher per
sequence, the token mask it puts on the sampler's logits, and the tokens fed back to it.

Invariants:
- Every sequence has a matcher of its own (`GrammarTokenizer.new_matcher`): samples of `n > 1` each theirs.
- `mask_logits` runs before every other adjustment of the logits: a disallowed token's logit is -inf, so greedy
  is the argmax over allowed tokens, and EOS is allowed only where the grammar accepts.
- `advance` feeds a sampled token to its matcher; a matcher in an error state raises `RequestFailedError`, which
  fails that request alone, never the step.
"""

from __future__ import annotations

import threading

import llguidance
import llguidance.torch
import tokenizers
import torch

from pagewise.engine.errors import InvalidRequestError, RequestFailedError
from pagewise.engine.structured_outputs import StructuredOutputsParams, parser_limits


class GrammarTokenizer:
    """The engine's vocabulary as llguidance sees it: built once (~0.2 s for SmolLM2's 49k tokens) and shared by
    every matcher of the engine. `prepare` (the step loop's first act) builds it on a thread of its own, so that a
    served engine's first constrained request does not stall its other streams (one that comes sooner waits for
    the build in progress); a matcher itself then costs 0.4–1.3 ms (a 60-property JSON schema), on the engine's
    thread when its request is added. `vocab_size` is the model's (its logits' width, added tokens included)."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, vocab_size: int, eos_token_ids: list[int]) -> None:
        self._source = (tokenizer, vocab_size, eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()
        self.vocab_size = vocab_size

    def prepare(self) -> None:
        """Start building the vocabulary in the background (idempotent with `get`: one build)."""
        threading.Thread(target=self.get, name="pagewise-grammar-vocabulary", daemon=True).start()

    def get(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                tokenizer, vocab_size, eos = self._source  # serialized only now: no cost to an engine not using it
                self._tokenizer = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=eos)
            return self._tokenizer

    def new_matcher(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence; a grammar that fails against this vocabulary is an
        `InvalidRequestError`."""
        matcher = llguidance.LLMatcher(self.get(), params.grammar_text, log_level=0, limits=parser_limits())
        if matcher.is_error():
            raise InvalidRequestError(f"structured_outputs cannot be enforced: {matcher.get_error()}",
                                      param="structured_outputs")
        return matcher


def mask_logits(logits: torch.Tensor, rows: list[int], matchers: list[llguidance.LLMatcher]) -> None:
    """Set to -inf, in place, every logit of `rows` that the row's matcher does not allow next."""
    vocab = logits.shape[1]
    words = (vocab + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for i, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, i)
        if matcher.is_error():
            raise RequestFailedError(f"structured output failed: {matcher.get_error()}")
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().reshape(len(rows), words * 32)[:, :vocab]
    index = torch.tensor(rows)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def advance(matcher: llguidance.LLMatcher, token_id: int) -> None:
    """Feed the sampled token to its sequence's matcher; its error (a token the grammar does not allow, a limit
    reached) fails the request."""
    if not matcher.consume_token(token_id) or matcher.is_error():
        raise RequestFailedError(f"structured output failed at token {token_id}: {matcher.get_error()}")
