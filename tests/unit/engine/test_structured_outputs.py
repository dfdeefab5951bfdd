"""Structured outputs: the parameters refuse what cannot be enforced (naming it); greedy under a grammar equals the
argmax of HF transformers' logits over the tokens the grammar allows, step by step; every output of the real
model validates against its schema (greedy and sampled, n > 1); a matcher's failure fails its request alone."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.torch
import pytest
import torch

from pagewise import LLM, SamplingParams, StructuredOutputsParams
from pagewise.engine.errors import InvalidRequestError, RequestFailedError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize(
    ("constraint", "param", "says"),
    [
        ({"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}, "json", "uniqueItems"),
        ({"json": {"type": "string", "format": "no-such-format"}}, "json", "no-such-format"),
        ({"json": "{not json"}, "json", "not valid JSON"),
        ({"regex": "(unclosed"}, "regex", "unclosed group"),
        ({"grammar": "start: undefined_rule"}, "grammar", "undefined_rule"),
        ({"choice": []}, "choice", "non-empty list"),
        ({}, None, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, None, "exactly one"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(constraint: dict, param: str | None, says: str) -> None:
    with pytest.raises(InvalidRequestError) as refused:
        StructuredOutputsParams(**constraint)
    assert says in str(refused.value)
    assert refused.value.param == "structured_outputs" + (f".{param}" if param else "")


def test_min_tokens_cannot_hold_back_the_end_of_a_document() -> None:
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=StructuredOutputsParams(json_object=True))


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    path, model = tiny_model("structured")
    return LLM(str(path), dtype="float32", progress=False), model


def test_greedy_is_the_argmax_of_hf_logits_over_allowed_tokens(tiny_llm, default_tokenizer) -> None:
    llm, hf = tiny_llm
    constraint = StructuredOutputsParams(json=PERSON)
    prompt = default_tokenizer.encode("A person as JSON:")
    [output] = llm.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=12, structured_outputs=constraint), use_tqdm=False
    )
    vocab = hf.config.vocab_size
    vocabulary = llguidance.LLTokenizer(default_tokenizer.backend.to_str(), n_vocab=vocab, eos_token=[2])
    matcher = llguidance.LLMatcher(vocabulary, constraint.grammar_text)
    bitmask = torch.empty((1, (vocab + 31) // 32), dtype=torch.int32)
    tokens: list[int] = []
    for _ in output.outputs[0].token_ids:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + tokens])).logits[0, -1]
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
        allowed = torch.tensor([(int(bitmask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)
        token = int(logits.masked_fill(~allowed, float("-inf")).argmax())
        assert matcher.consume_token(token)
        tokens.append(token)
    assert list(output.outputs[0].token_ids) == tokens
    assert len(tokens) == 12  # the random model rambles inside the document: cut by max_tokens
    assert output.outputs[0].finish_reason == "length"


def test_a_failed_matcher_fails_its_request_alone(tiny_llm, default_tokenizer) -> None:
    llm, _ = tiny_llm
    engine = llm.engine
    constrained = SamplingParams(temperature=0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    engine.add_request("broken", default_tokenizer.encode("x"), constrained)
    engine.add_request("bystander", default_tokenizer.encode("y"), SamplingParams(temperature=0, max_tokens=8))
    [broken] = [s.request for s in engine._groups["broken"].samples]
    broken.matcher.consume_token(default_tokenizer.encode("zzz", add_special_tokens=False)[0])  # not "a": error
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    assert isinstance(outputs["broken"].error, RequestFailedError)
    assert "structured output failed" in str(outputs["broken"].error)
    assert outputs["bystander"].error is None and len(outputs["bystander"].outputs[0].token_ids) == 8


@pytest.fixture(scope="module")
def smollm() -> LLM:
    return LLM(progress=False)


def _chat(llm: LLM, question: str) -> list[int]:
    return llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def test_every_output_of_the_real_model_validates_against_its_schema(smollm: LLM) -> None:
    prompt = _chat(smollm, "Describe a person named Ada, aged 36, as JSON.")
    constraint = StructuredOutputsParams(json=PERSON)
    greedy = SamplingParams(temperature=0, max_tokens=120, structured_outputs=constraint)
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=120, structured_outputs=constraint)
    outputs = [c for o in smollm.generate([prompt, prompt], [greedy, sampled], use_tqdm=False) for c in o.outputs]
    assert len(outputs) == 4
    for completion in outputs:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), PERSON)


def test_choice_regex_and_json_object(smollm: LLM) -> None:
    cases = [
        (StructuredOutputsParams(choice=["yes", "no", "maybe"]), lambda text: text in ("yes", "no", "maybe")),
        (StructuredOutputsParams(regex=r"\d{3}-\d{4}"), lambda text: re.fullmatch(r"\d{3}-\d{4}", text)),
        (StructuredOutputsParams(json_object=True), lambda text: isinstance(json.loads(text), dict)),
    ]
    question = _chat(smollm, "Is the sky blue? Answer, then give a phone number and a JSON object.")
    # The JSON case asks for a short object: asked the question above, the model may ramble inside a JSON string
    # past any max_tokens, which the grammar allows, and whether it does turns on the last bits of the logits.
    ask_json = _chat(smollm, 'Give a JSON object with two keys: "answer" (is the sky blue? yes or no) and "phone" '
                             "(a phone number).")  # fmt: skip
    params = [SamplingParams(temperature=0.7, seed=3, max_tokens=300, structured_outputs=c) for c, _ in cases]
    outputs = smollm.generate([question, question, ask_json], params, use_tqdm=False)
    for (_, valid), output in zip(cases, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop" and valid(completion.text), completion.text
