"""A tokenizer as protocol data: what a worker publishes in its `EngineInfo` so that API replicas, which load no
model files, rebuild the same tokenizer. `tokenizer_from_spec(tokenizer_spec(t))` encodes, decodes and renders
chat templates exactly as `t` does."""

from __future__ import annotations

import tokenizers

from pagewise.engine.tokenizer import Tokenizer
from pagewise.serving.protocol import TokenizerSpec


def tokenizer_spec(tokenizer: Tokenizer) -> TokenizerSpec:
    """What a worker publishes so that API replicas rebuild its tokenizer without the model files."""
    return TokenizerSpec(
        tokenizer_json=tokenizer.backend.to_str(),
        eos_token_ids=list(tokenizer.eos_token_ids),
        chat_template=tokenizer.chat_template,
        special_tokens=dict(tokenizer.special_tokens),
    )


def tokenizer_from_spec(spec: TokenizerSpec) -> Tokenizer:
    """The tokenizer a worker's `tokenizer_spec` describes."""
    return Tokenizer(
        tokenizers.Tokenizer.from_str(spec.tokenizer_json),
        tuple(spec.eos_token_ids),
        chat_template=spec.chat_template,
        special_tokens=spec.special_tokens,
    )
