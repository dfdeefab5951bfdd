"""The real default model (SmolLM2-135M-Instruct from the GGUF): greedy equals HF transformers token for token
on chat and plain prompts, batched in one engine; plus the text path (detokenization, stop strings, chat)."""

from __future__ import annotations

import pytest
import torch

from pagewise import LLM, SamplingParams

MAX_TOKENS = 24

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4,",
]
CHAT = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(progress=False, dtype="float32")


def hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_greedy_matches_hf_on_real_weights(llm: LLM, hf_smollm2) -> None:
    tok = llm.tokenizer
    batch = [tok.encode(p) for p in PLAIN] + [tok.apply_chat_template(c) for c in CHAT]
    outputs = llm.generate(batch, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    for prompt, output in zip(batch, outputs, strict=True):
        assert output.outputs[0].token_ids == hf_greedy(hf_smollm2, prompt)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


def test_chat_answers_sensibly(llm: LLM) -> None:
    (out,) = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=16),
        use_tqdm=False,
    )
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on EOS, which is not in the text


def test_stop_string_cuts_text(llm: LLM) -> None:
    params = SamplingParams(temperature=0, max_tokens=32, stop=["Paris"])
    (out,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "Paris"
    assert "Paris" not in completion.text and completion.text


def test_text_equals_decode_of_tokens(llm: LLM) -> None:
    (out,) = llm.generate(
        "Write the word café and an emoji: ", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False
    )
    completion = out.outputs[0]
    assert completion.text == llm.tokenizer.decode(completion.token_ids)
