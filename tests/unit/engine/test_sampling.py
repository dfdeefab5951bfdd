"""Sampling on tiny random-weight models, checked against exact expectations: seeded reproducibility, the
greedy-equivalent settings, penalties against a reference implementation over HF logits, stop conditions, and
logprobs against ``log_softmax`` of HF transformers' logits."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine.model_runner import KVCache
from pagewise.engine.request import Request
from pagewise.engine.sampler import Sampler

BLOCK = 4
NUM_BLOCKS = 256
VOCAB = 49152
MAX_TOKENS = 8
FLAT = dict(initializer_range=0.01)  # logits span < 2 (the largest allowed penalty) at every step


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


P1, P2, P3 = _prompt(9, 1), _prompt(3, 2), _prompt(14, 3)


def _per_block(model) -> int:
    cfg = model.config
    return KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads,
                                   cfg.hidden_size // cfg.num_attention_heads, torch.float32)


def _llm(path, model) -> LLM:
    return LLM(
        str(path),
        block_size=BLOCK,
        kv_cache_memory_bytes=NUM_BLOCKS * _per_block(model),
        progress=False,
        dtype="float32",
    )


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("sampling-llama")


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    return _llm(*tiny)


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def hf_log_softmax(model, tokens: list[int], start: int) -> torch.Tensor:
    """``log_softmax`` of HF's logits at positions ``start - 1 .. len(tokens) - 2`` (each predicts the next)."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits[start - 1 : len(tokens) - 1], dim=-1)


def hf_penalized_greedy(
    model,
    prompt: list[int],
    n: int,
    presence: float = 0.0,
    frequency: float = 0.0,
    repetition: float = 1.0,
    bias: dict[int, float] | None = None,
    banned: frozenset[int] = frozenset(),
) -> list[int]:
    """vLLM's logits processing, then argmax: ``logit_bias`` added; ``banned`` tokens masked (as ``min_tokens``
    masks stop tokens); repetition over prompt + output (positive logits divided, negative multiplied); then over
    the output ``logit -= frequency * count + presence * (count > 0)`` (OpenAI's penalties)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            for token, value in (bias or {}).items():
                logits[token] += value
            logits[list(banned)] = float("-inf")
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[prompt + out] = True
            scaled = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits = torch.where(seen, scaled, logits)
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.shape[0]).float()
            logits = logits - frequency * counts - presence * (counts > 0).float()
            out.append(int(logits.argmax()))
    return out


def run(llm: LLM, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in run(llm, prompts, params)]


@pytest.fixture(scope="module")
def greedy_p1(tiny) -> list[int]:
    return hf_greedy(tiny[1], P1, MAX_TOKENS)


# ---- seeds


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(
        temperature=kw.pop("temperature", 1.0), seed=seed, max_tokens=MAX_TOKENS, ignore_eos=True, **kw
    )


def test_seeded_sampling_is_reproducible_across_calls_and_batches(llm) -> None:
    (first,) = tokens(llm, [P1], seeded(1234))
    assert len(first) == MAX_TOKENS
    assert tokens(llm, [P1], seeded(1234)) == [first]
    batch = tokens(
        llm,
        [P2, P1, P3, P1],
        [
            SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True),  # unseeded: uses the engine generator
            seeded(1234),
            seeded(99, temperature=0.7),
            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        ],
    )
    assert batch[1] == first
    # Again after the engine generator has advanced, alone, with a different prompt ahead of it in the batch.
    assert tokens(llm, [P3, P1], [seeded(7), seeded(1234)])[1] == first


def test_different_seeds_differ(llm) -> None:
    outs = {tuple(tokens(llm, [P1], seeded(s))[0]) for s in (1, 2, 3)}
    assert len(outs) == 3


def test_n_samples_use_consecutive_seeds(llm) -> None:
    (out,) = run(llm, [P1], SamplingParams(n=3, temperature=1.0, seed=40, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == MAX_TOKENS for c in out.outputs)
    singles = [tokens(llm, [P1], seeded(40 + i))[0] for i in range(3)]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3


def test_n_greedy_samples_are_all_greedy(llm, greedy_p1) -> None:
    (out,) = run(llm, [P1], SamplingParams(n=3, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert [c.token_ids for c in out.outputs] == [greedy_p1] * 3


# ---- settings equivalent to greedy


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0),
        dict(temperature=0, top_k=5, top_p=0.5, min_p=0.2, seed=3),
        dict(temperature=1.5, top_k=1, seed=5),
        dict(temperature=1.0, top_p=1e-6),
        dict(temperature=2.0, min_p=1.0, seed=5),
        dict(temperature=1e-6),
        dict(temperature=9e-6, top_k=40, seed=2),
    ],
    ids=repr,
)
def test_greedy_equivalent_settings(llm, greedy_p1, kwargs) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs)
    assert tokens(llm, [P1], params)[0] == greedy_p1


# ---- penalties


@pytest.fixture(scope="module")
def flat(tiny_model):
    path, model = tiny_model("sampling-flat", **FLAT)
    return _llm(path, model), model


@pytest.mark.parametrize(
    ("presence", "frequency"),
    [(0.0, 2.0), (2.0, 0.0), (0.5, 1.0), (0.3, -0.7), (-1.0, 0.0)],
)
def test_penalties_match_reference(flat, presence, frequency) -> None:
    llm, model = flat
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency
    )
    assert tokens(llm, [P2], params)[0] == hf_penalized_greedy(model, P2, 10, presence, frequency)


@pytest.mark.parametrize("kwargs", [dict(frequency_penalty=2.0), dict(presence_penalty=2.0)], ids=repr)
def test_max_penalty_prevents_repeats(flat, kwargs) -> None:
    llm, model = flat
    with torch.no_grad():
        logits = model(torch.tensor([P2 + hf_greedy(model, P2, 10)])).logits[0]
    span = float((logits.max(-1).values - logits.min(-1).values).max())
    assert span < 2.0, "test set-up: the flat model's logits must span less than the penalty"
    plain = tokens(llm, [P2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert len(set(plain)) < len(plain), "test set-up: unpenalized greedy repeats on this model"
    penalized = tokens(llm, [P2], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, **kwargs))[0]
    assert len(penalized) == 10
    assert len(set(penalized)) == 10


@pytest.mark.parametrize("repetition", [1.5, 0.7, 3.0])
def test_repetition_penalty_matches_reference(flat, repetition) -> None:
    llm, model = flat
    params = SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=repetition, frequency_penalty=0.3
    )
    assert tokens(llm, [P2], params)[0] == hf_penalized_greedy(model, P2, 10, 0.0, 0.3, repetition)


def test_logit_bias_matches_reference(llm, tiny, greedy_p1) -> None:
    bias = {greedy_p1[0]: -100.0, greedy_p1[3]: 2.5, 7: -0.5}
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias=bias)
    assert tokens(llm, [P1], params)[0] == hf_penalized_greedy(tiny[1], P1, MAX_TOKENS, bias=bias)


@pytest.mark.parametrize(
    "kwargs", [dict(temperature=0), dict(temperature=1.5, seed=4), dict(temperature=1.0)], ids=repr
)
def test_logit_bias_of_100_forces_a_token(llm, kwargs) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logit_bias={4242: 100}, **kwargs)
    assert tokens(llm, [P1], params)[0] == [4242] * MAX_TOKENS


def test_new_processing_keeps_rows_independent(llm) -> None:
    """A seeded row with bias, penalties and min_tokens samples the same tokens alone and in a mixed batch."""
    mine = seeded(77, repetition_penalty=1.3, presence_penalty=0.5, logit_bias={11: 3.0, 12: -3.0}, min_tokens=4)
    (alone,) = tokens(llm, [P1], mine)
    batch = tokens(
        llm,
        [P2, P1, P3],
        [
            SamplingParams(temperature=0.8, max_tokens=6, ignore_eos=True, logit_bias={5: 50.0}),
            mine,
            SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, repetition_penalty=2.0, frequency_penalty=1.0),
        ],
    )
    assert batch[1] == alone


def test_a_failing_row_fails_alone(llm, greedy_p1) -> None:
    """A row whose sampling raises (here: parameters corrupted after validation) fails only its request; the
    rest of the batch gets exactly what it gets without it."""
    engine = llm.engine
    bad = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    engine.add_request("good", P1, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    engine.add_request("bad", P2, bad)
    bad.logit_bias = {VOCAB + 7: 1.0}  # out of the vocabulary: indexing its logit raises
    finals = {}
    while engine.has_unfinished_requests():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert finals["good"].outputs[0].token_ids == greedy_p1 and finals["good"].error is None
    failed = finals["bad"]
    assert failed.outputs[0].finish_reason == "error" and failed.outputs[0].token_ids == []
    assert "sampling its next token" in str(failed.error) and isinstance(failed.error.__cause__, IndexError)
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]


# ---- stopping


def test_max_tokens_respected(llm, greedy_p1) -> None:
    for max_tokens in (1, 5):
        (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        completion = out.outputs[0]
        assert completion.token_ids == greedy_p1[:max_tokens]
        assert (completion.finish_reason, completion.stop_reason) == ("length", None)
        assert out.finished


def _first_new_index(seq: list[int], start: int = 2) -> int:
    index = next((i for i in range(start, len(seq)) if seq[i] not in seq[:i]), None)
    assert index is not None, "test set-up: greedy output without a fresh token"
    return index


def test_stop_token_ids(llm, greedy_p1) -> None:
    k = _first_new_index(greedy_p1)
    stop = greedy_p1[k]
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop, 0]))
    completion = out.outputs[0]
    assert completion.token_ids == greedy_p1[: k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    # ignore_eos does not disable stop_token_ids
    (out,) = run(
        llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    )
    assert out.outputs[0].token_ids == greedy_p1[: k + 1]


def test_stop_token_text_is_left_out_unless_included(llm, greedy_p1) -> None:
    k = _first_new_index(greedy_p1)
    stop = greedy_p1[k]
    before, through = (
        run(llm, [P1], SamplingParams(temperature=0, max_tokens=m, ignore_eos=True))[0].outputs[0] for m in (k, k + 1)
    )
    assert through.text != before.text, "test set-up: the stop token has text"
    for include, want in ((False, before.text), (True, through.text)):
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], include_stop_str_in_output=include
        )
        (out,) = run(llm, [P1], params)
        assert out.outputs[0].token_ids == greedy_p1[: k + 1]  # the id stays, as in vLLM
        assert out.outputs[0].text == want


@pytest.fixture(scope="module")
def eos_llm(tiny, greedy_p1, tmp_path_factory):
    """The tiny model with its EOS id set to the first fresh token of ``greedy_p1`` (index ``k``)."""
    path, model = tiny
    k = _first_new_index(greedy_p1)
    copy = tmp_path_factory.mktemp("eos-model")
    shutil.copytree(path, copy, dirs_exist_ok=True)
    for name in ("generation_config.json", "config.json"):
        data = json.loads((copy / name).read_text())
        data["eos_token_id"] = [greedy_p1[k]] if name == "generation_config.json" else greedy_p1[k]
        (copy / name).write_text(json.dumps(data))
    return _llm(copy, model), k


def test_eos_stops_unless_ignore_eos(eos_llm, greedy_p1) -> None:
    llm, k = eos_llm
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS))
    completion = out.outputs[0]
    assert completion.token_ids == greedy_p1[: k + 1]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert out.outputs[0].token_ids == greedy_p1
    assert out.outputs[0].finish_reason == "length"


def test_min_tokens_delays_eos(eos_llm, tiny, greedy_p1) -> None:
    llm, k = eos_llm
    eos = greedy_p1[k]
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS))
    completion = out.outputs[0]
    assert completion.token_ids == hf_penalized_greedy(tiny[1], P1, MAX_TOKENS, banned=frozenset({eos}))
    assert eos not in completion.token_ids and completion.finish_reason == "length"
    # Sampled too: whatever the seed, EOS never comes before min_tokens outputs.
    for seed in range(4):
        (out,) = run(
            llm,
            [P1],
            SamplingParams(temperature=1.5, seed=seed, max_tokens=MAX_TOKENS, min_tokens=5, logit_bias={eos: 5.0}),
        )
        ids = out.outputs[0].token_ids
        assert eos not in ids[:5] and len(ids) >= 6


def test_min_tokens_delays_stop_token_ids(llm, tiny, greedy_p1) -> None:
    k = _first_new_index(greedy_p1)
    stop = greedy_p1[k]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], min_tokens=k + 1)
    (out,) = run(llm, [P1], params)
    want = hf_penalized_greedy(tiny[1], P1, k + 1, banned=frozenset({stop}))
    assert out.outputs[0].token_ids[: k + 1] == want
    assert stop not in out.outputs[0].token_ids[: k + 1]


def test_min_tokens_defers_stop_strings(llm, greedy_p1) -> None:
    (full,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    text = full.outputs[0].text
    stop = text[:3]
    assert text.count(stop) == 1, "test set-up: a stop string that occurs once, at the start"
    (cut,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]))
    assert (cut.outputs[0].text, cut.outputs[0].finish_reason) == ("", "stop")
    (late,) = run(
        llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], min_tokens=2)
    )
    assert (late.outputs[0].text, late.outputs[0].finish_reason) == (text, "length")


def test_stop_string_cuts_text(llm, greedy_p1) -> None:
    (full,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    text = full.outputs[0].text
    assert text == llm.tokenizer.decode(greedy_p1)
    middle = len(text) // 2
    stop = text[middle : middle + 3]
    assert stop.strip(), "test set-up: a visible stop string"
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]))
    completion = out.outputs[0]
    assert completion.text == text[: text.find(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    assert completion.token_ids == greedy_p1[: len(completion.token_ids)]
    assert len(completion.token_ids) < MAX_TOKENS or text.find(stop) + len(stop) > len(text) - 3
    params = SamplingParams(
        temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop], include_stop_str_in_output=True
    )
    (kept,) = run(llm, [P1], params)
    assert kept.outputs[0].text == text[: text.find(stop) + len(stop)]
    assert kept.outputs[0].token_ids == completion.token_ids


# ---- logprobs


def test_greedy_logprobs_equal_hf_log_softmax(llm, tiny, greedy_p1) -> None:
    _, model = tiny
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5))
    completion = out.outputs[0]
    assert completion.token_ids == greedy_p1
    assert len(completion.logprobs) == MAX_TOKENS
    reference = hf_log_softmax(model, P1 + greedy_p1, len(P1))
    for step, (token, entries) in enumerate(zip(greedy_p1, completion.logprobs, strict=True)):
        ids = list(entries)
        assert ids[0] == token and entries[token].rank == 1
        assert len(entries) == 5
        assert [e.rank for e in entries.values()] == [1, 2, 3, 4, 5]
        values = [e.logprob for e in entries.values()]
        assert values == sorted(values, reverse=True)
        hf_values, hf_ids = reference[step].topk(5)
        assert ids == hf_ids.tolist()
        assert values == pytest.approx(hf_values.tolist(), abs=1e-4)
        assert all(e.decoded_token == llm.tokenizer.decode([t], skip_special_tokens=False) for t, e in entries.items())


@pytest.mark.parametrize("k", [0, 2])
def test_sampled_logprobs_carry_the_sampled_token_and_its_rank(llm, tiny, k) -> None:
    _, model = tiny
    (out,) = run(
        llm, [P1], SamplingParams(temperature=1.5, seed=21, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=k)
    )
    completion = out.outputs[0]
    reference = hf_log_softmax(model, P1 + completion.token_ids, len(P1))
    for step, (token, entries) in enumerate(zip(completion.token_ids, completion.logprobs, strict=True)):
        ids = list(entries)
        assert ids[0] == token
        hf_top = reference[step].topk(k).indices.tolist() if k else []
        assert ids[1:] == [t for t in hf_top if t != token]
        for tid, entry in entries.items():
            hf = reference[step]
            assert entry.logprob == pytest.approx(float(hf[tid]), abs=1e-4)
            low = int((hf > entry.logprob + 1e-4).sum()) + 1
            high = int((hf > entry.logprob - 1e-4).sum()) + 1
            assert low <= entry.rank <= high
    assert len({len(e) for e in completion.logprobs} - {k, k + 1, 1}) == 0


def test_no_logprobs_unless_asked(llm) -> None:
    (out,) = run(llm, [P1], SamplingParams(temperature=0, max_tokens=2))
    assert out.outputs[0].logprobs is None


# ---- the batched sampler, on its own


def _sampler(seed: int = 0) -> Sampler:
    return Sampler(torch.Generator().manual_seed(seed), str, [0])


def _request(params: SamplingParams, seed: int | None = None) -> Request:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return Request("r", [1, 2, 3], params, 0, generator=generator)


def _draws(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[int]:
    return [r.token_id for r in sampler(logits, requests)]


def test_a_greedy_row_takes_the_first_of_tied_maxima() -> None:
    """Greedy rows take the lowest id among equal top logits (torch's argmax rule), wherever the ties sit."""
    logits = torch.zeros(3, 4096)
    logits[0, [7, 3000]] = 2.0
    logits[1, [4095, 100, 2048]] = 1.5
    logits[2] = -1.0  # the whole row tied
    assert _draws(_sampler(), logits, [_request(SamplingParams(temperature=0))] * 3) == [7, 100, 0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"logprobs": 0},
        {"logit_bias": {5: 3.0}},
        {"min_tokens": 2},
        {"repetition_penalty": 1.2},
        {"temperature": 0.5},
    ],
)
def test_a_plain_greedy_batch_takes_its_argmax_in_the_lm_heads_dtype(kwargs) -> None:
    """A batch of plain greedy rows is argmax-only and gives the tokens of its bf16 logits and of their fp32
    widening alike; one row asking for anything that reads the logits (log-probabilities, a bias, the min-tokens
    mask, a penalty, a temperature) makes the whole batch fp32, and its greedy rows keep their tokens."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(4, 4096, generator=gen) * 6).bfloat16()
    plain = [_request(SamplingParams(temperature=0)) for _ in range(4)]
    assert Sampler.argmax_only(plain)
    expected = logits.float().argmax(-1).tolist()
    assert _draws(_sampler(), logits, plain) == expected
    assert _draws(_sampler(), logits.float(), plain) == expected
    other = _request(SamplingParams(**{"temperature": 0, "max_tokens": 4, **kwargs}), seed=1)
    assert not Sampler.argmax_only([*plain[:3], other])
    results = _sampler()(logits, [*plain[:3], other])
    assert [r.token_id for r in results[:3]] == expected[:3]
    assert not isinstance(results[3], Exception)


PROBS = torch.tensor([0.30, 0.25, 0.15, 0.12, 0.08, 0.05, 0.03, 0.02])


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # top-p over the renormalized top-5 (0.3, 0.25, 0.15, 0.12, 0.08) / 0.9: 0.75 is reached after three
        (dict(top_k=5, top_p=0.75), [0.30, 0.25, 0.15, 0, 0, 0, 0, 0]),
        (dict(top_k=2), [0.30, 0.25, 0, 0, 0, 0, 0, 0]),
        (dict(top_p=0.6), [0.30, 0.25, 0.15, 0, 0, 0, 0, 0]),
        (dict(min_p=0.2), [0.30, 0.25, 0.15, 0.12, 0.08, 0, 0, 0]),
        (dict(temperature=0.5), (PROBS**2).tolist()),
        (dict(temperature=0.5, top_k=7, top_p=0.9), (PROBS**2)[:4].tolist() + [0] * 4),
    ],
    ids=repr,
)
def test_batched_draws_follow_the_distribution(kwargs, expected) -> None:
    n = 20000
    params = SamplingParams(**{"temperature": 1.0, **kwargs})
    counts = torch.bincount(
        torch.tensor(_draws(_sampler(), PROBS.log().expand(n, -1), [_request(params)] * n)), minlength=len(PROBS)
    )
    want = torch.tensor(expected) / sum(expected)
    assert (counts / n - want).abs().max() < 0.02
    assert (counts[want == 0] == 0).all()


def test_a_seeded_row_draws_the_same_alone_or_batched_ties_included() -> None:
    """Whatever top-k the other rows use (so whatever ``topk`` width the batch needs), a seeded row's draws are
    the same; its logits tie at its top-k cut and within it."""
    torch.manual_seed(0)
    mine_logits = torch.randn(64) * 0.5
    mine_logits[[5, 9, 17, 30]] = torch.tensor([4.0, 3.0, 3.0, 3.0])  # top-3 cuts inside a three-way tie
    mine = SamplingParams(temperature=1.0, top_k=3, top_p=0.9)
    others = [
        SamplingParams(temperature=0.7, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, top_k=3),
    ]
    logits = torch.cat([torch.randn(2, 64), mine_logits[None], torch.randn(2, 64)])
    for seed in range(30):
        (alone,) = _draws(_sampler(), mine_logits[None], [_request(mine, seed)])
        batch = [
            _request(others[0]),
            _request(others[1], 5),
            _request(mine, seed),
            _request(others[2]),
            _request(others[3], 6),
        ]
        assert _draws(_sampler(seed), logits, batch)[2] == alone
        assert alone in (5, 9, 17, 30)


def test_a_row_failing_in_the_batched_draw_fails_alone() -> None:
    """A row whose parameters break the batched candidate search (corrupted after validation) gets its error;
    the others draw exactly what they draw without it."""
    torch.manual_seed(1)
    logits = torch.randn(3, 100)
    good = [SamplingParams(temperature=1.0, top_k=10, top_p=0.8), SamplingParams(temperature=0.6, top_p=0.9)]
    bad = SamplingParams(temperature=1.0, top_k=5)
    bad.top_k = "five"
    without = _draws(_sampler(), logits[[0, 2]], [_request(good[0], 1), _request(good[1], 2)])
    results = _sampler()(logits, [_request(good[0], 1), _request(bad, 3), _request(good[1], 2)])
    assert isinstance(results[1], TypeError)
    assert [results[0].token_id, results[2].token_id] == without


def test_top_candidates_equal_a_stable_sort_of_the_row_when_values_tie() -> None:
    """``_top`` over rows full of ties (quantized probabilities, as real bf16 logits give) returns, per row, the
    first ``length`` entries of a stable descending sort of that row: values and ids, ties broken by id."""
    from pagewise.engine.sampler import _top

    gen = torch.Generator().manual_seed(3)
    for case in range(40):
        rows, vocab = 6, 500
        probs = torch.randint(0, 12, (rows, vocab), generator=gen).float() / 11  # a handful of levels: many ties
        probs[0, :] = 0.0
        probs[0, [7, 3, 11]] = 0.5  # a row whose positives are fewer than its length
        lengths = torch.randint(1, 120, (rows,), generator=gen).tolist()
        values, ids = _top(probs, lengths)
        for row, n in enumerate(lengths):
            want_values, want_ids = probs[row].sort(descending=True, stable=True)
            positive = int((want_values[:n] > 0).sum())
            assert torch.equal(values[row, :n], want_values[:n]), (case, row)
            assert torch.equal(ids[row, :positive], want_ids[:positive]), (case, row)
