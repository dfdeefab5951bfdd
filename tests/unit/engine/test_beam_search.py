"""Beam search (``LLM.beam_search``) equals HF transformers' ``generate(num_beams=k, num_return_sequences=k,
do_sample=False)`` — same sequences, same order — on a tiny random model, with and without a reachable EOS, for
several length penalties and every ``early_stopping`` mode; it runs on the prefix cache (each step hits exactly
the full blocks its parent beams computed, a shared prefix's block exists once) and leaves every block free; bad
parameters raise ``InvalidRequestError`` and leave the engine usable."""

from __future__ import annotations

import collections
import copy
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from pagewise import LLM, BeamSearchParams, SamplingParams
from pagewise.engine.errors import InvalidRequestError, PromptTooLongError
from pagewise.engine.model_runner import KVCache

BLOCK = 4
NUM_BLOCKS = 512
MAX_TOKENS = 8
VOCAB = 49152
EOS = 2
LENGTHS = [1, 4, 7, 13]  # shorter than a block, exactly one, partial last block, several blocks
PROMPTS = [[random.Random(10 + i).randrange(3, VOCAB) for _ in range(n)] for i, n in enumerate(LENGTHS)]
# EOS's output embedding = 4 x the mean of the output embeddings of tokens random beams favour: EOS becomes
# likely enough to end hypotheses at every length, and sometimes ranks below the first k (where HF drops it).
EOS_BOOST = 4.0


def hf_beam_search(
    model: torch.nn.Module,
    prompt: list[int],
    k: int,
    max_new_tokens: int = MAX_TOKENS,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    eos_token_id: int | list[int] | None = None,
) -> tuple[list[list[int]], list[float]]:
    """HF's returned sequences (generated part, cut to each one's own length) and their scores, best first."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            num_beams=k,
            num_return_sequences=k,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=None,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            eos_token_id=eos_token_id,
            pad_token_id=0,
            return_dict_in_generate=True,
            output_scores=True,
        )
    lengths = (out.beam_indices >= 0).sum(dim=1).tolist()
    sequences = [out.sequences[i, len(prompt) : len(prompt) + n].tolist() for i, n in enumerate(lengths)]
    return sequences, out.sequences_scores.tolist()


def _save_variant(model: torch.nn.Module, source: Path, target: Path, eos_ids: list[int]) -> Path:
    model.save_pretrained(target)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    return target


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    """A tiny random llama whose EOS (id 2) is made reachable: its output embedding points where the tokens
    random beams favour point. Returns (path, hf_model, frequent tokens)."""
    path, base = tiny_model("beam-search-llama")
    counts: collections.Counter[int] = collections.Counter()
    for prompt in PROMPTS:
        sequences, _ = hf_beam_search(base, prompt, 4)
        for sequence in sequences:
            counts.update(sequence)
    frequent = [t for t, _ in counts.most_common(16)]
    model = copy.deepcopy(base)
    with torch.no_grad():
        model.lm_head.weight[EOS] = EOS_BOOST * model.lm_head.weight[frequent].mean(dim=0)
    eos_path = _save_variant(model, path, tmp_path_factory.mktemp("beam-search-eos"), [EOS])
    return eos_path, model.eval(), frequent


def make_llm(path: Path, model: torch.nn.Module, **kwargs) -> LLM:
    cfg = model.config
    per_block = KVCache.bytes_per_block(
        cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
        torch.float32,
    )
    kwargs.setdefault("kv_cache_memory_bytes", NUM_BLOCKS * per_block)
    return LLM(str(path), block_size=BLOCK, progress=False, **({"dtype": "float32"} | kwargs))


@pytest.fixture(scope="module")
def llm(eos_model) -> LLM:
    path, model, _ = eos_model
    return make_llm(path, model)


def assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0


def assert_matches_hf(
    outputs, expected: list[tuple[list[list[int]], list[float]]], length_penalty: float, eos: int | None
) -> None:
    assert len(outputs) == len(expected)
    for output, prompt, (sequences, scores) in zip(outputs, PROMPTS, expected, strict=True):
        assert output.prompt_token_ids == prompt
        assert [s.token_ids for s in output.sequences] == sequences
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        for s in output.sequences:
            assert s.score == pytest.approx(s.cum_logprob / len(s.token_ids) ** length_penalty, rel=1e-5)
            assert s.finish_reason == ("stop" if s.token_ids[-1] == eos else "length")
            assert s.finish_reason == "stop" or len(s.token_ids) == MAX_TOKENS


@pytest.mark.parametrize("k", [2, 4])
def test_matches_hf_with_eos_ignored(eos_model, llm, k: int) -> None:
    _, model, _ = eos_model
    expected = [hf_beam_search(model, p, k, eos_token_id=None) for p in PROMPTS]
    outputs = llm.beam_search(PROMPTS, BeamSearchParams(k, MAX_TOKENS, ignore_eos=True))
    assert_matches_hf(outputs, expected, 1.0, None)
    assert all(len(s.token_ids) == MAX_TOKENS for o in outputs for s in o.sequences)
    assert any(EOS in s.token_ids for o in outputs for s in o.sequences)  # EOS was there to be ignored
    assert_all_blocks_free(llm)


# (length_penalty, early_stopping, what the case exercises on this model)
EOS_CASES = [
    (1.0, False, "stops-early"),  # the heuristic ends the search before max_tokens for some prompt
    (-1.0, False, "stops-early"),  # negative penalty favours short hypotheses
    (2.0, False, "eos"),  # strong length reward
    (0.5, True, "stops-early"),  # stop as soon as k hypotheses are finished
    (1.0, True, "stops-early"),
    (2.0, "never", "any"),  # canonical: best possible length is max_tokens
    (0.0, "never", "eos"),  # length_penalty 0: "never" falls back to the current length
]


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize(("length_penalty", "early_stopping", "exercises"), EOS_CASES)
def test_matches_hf_with_eos(eos_model, llm, k: int, length_penalty, early_stopping, exercises: str) -> None:
    _, model, _ = eos_model
    expected = [
        hf_beam_search(model, p, k, length_penalty=length_penalty, early_stopping=early_stopping, eos_token_id=EOS)
        for p in PROMPTS
    ]
    params = BeamSearchParams(k, MAX_TOKENS, length_penalty=length_penalty, early_stopping=early_stopping)
    requests_before = llm.stats()["generation_tokens_total"]  # one token per beam request
    outputs = llm.beam_search(PROMPTS, params)
    num_requests = llm.stats()["generation_tokens_total"] - requests_before
    assert_matches_hf(outputs, expected, length_penalty, EOS)
    assert all(len(o.sequences) == k for o in outputs)
    ended_on_eos = [s.finish_reason == "stop" for o in outputs for s in o.sequences]
    if exercises in ("eos", "stops-early"):
        assert any(ended_on_eos)
    if exercises == "stops-early":  # fewer steps than max_tokens for some prompt
        assert num_requests < len(PROMPTS) * (1 + k * (MAX_TOKENS - 1))
    assert_all_blocks_free(llm)


def test_matches_hf_with_several_eos_ids(eos_model, tmp_path: Path) -> None:
    """Two EOS ids: HF keeps (1 + 2) x k candidates per step, and so do we (3k logprobs per request)."""
    path, model, frequent = eos_model
    eos_ids = [EOS, frequent[0]]
    llm = make_llm(_save_variant(model, path, tmp_path / "two-eos", eos_ids), model)
    for k in (2, 4):
        expected = [hf_beam_search(model, p, k, eos_token_id=eos_ids) for p in PROMPTS]
        outputs = llm.beam_search(PROMPTS, BeamSearchParams(k, MAX_TOKENS))
        for output, (sequences, scores) in zip(outputs, expected, strict=True):
            assert [s.token_ids for s in output.sequences] == sequences
            assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
        assert any(s.token_ids[-1] == frequent[0] for o in outputs for s in o.sequences)
    with pytest.raises(InvalidRequestError, match="log-probabilities"):
        llm.beam_search(PROMPTS[0], BeamSearchParams(7, MAX_TOKENS))  # 21 candidates > 20 logprobs
    assert_all_blocks_free(llm)


def test_max_model_len_caps_max_tokens(eos_model) -> None:
    path, model, _ = eos_model
    llm = make_llm(path, model, max_model_len=16)
    prompt = PROMPTS[3]  # 13 tokens: 3 more fit
    expected, _ = hf_beam_search(model, prompt, 2, max_new_tokens=3, eos_token_id=None)
    (output,) = llm.beam_search(prompt, BeamSearchParams(2, MAX_TOKENS, ignore_eos=True))
    assert [s.token_ids for s in output.sequences] == expected
    assert all(s.finish_reason == "length" for s in output.sequences)


def test_each_step_hits_its_parents_blocks_and_shares_prefix_blocks(eos_model) -> None:
    """Every step's requests hit exactly the full blocks their parent beams computed (only the last block is
    computed again), and while a step runs, the blocks in use are one per distinct full-block prefix across the
    beams plus one tail block per beam: the KV of a shared prefix exists once. Afterwards every block is free."""
    path, model, _ = eos_model
    llm = make_llm(path, model)
    engine = llm.engine
    submitted: list[list[int]] = []
    in_use: list[tuple[int, int]] = []  # (blocks in use, blocks expected) per engine step
    add_request, start = engine.add_request, engine.runner.start

    def recording_add_request(request_id, prompt, params=None, tenant_id=None, **kwargs):
        submitted.append(list(prompt))
        return add_request(request_id, prompt, params, tenant_id, **kwargs)

    def checking_start(step):
        prompts = [r.prompt_token_ids for r in step.scheduled]
        prefixes = {tuple(p[: BLOCK * (j + 1)]) for p in prompts for j in range((len(p) - 1) // BLOCK)}
        in_use.append((engine.num_blocks - engine.pool.num_free, len(prefixes) + len(prompts)))
        return start(step)

    engine.add_request = recording_add_request
    engine.runner.start = checking_start
    k, prompt = 4, PROMPTS[3]
    (output,) = llm.beam_search(prompt, BeamSearchParams(k, MAX_TOKENS, ignore_eos=True), tenant_id="t1")
    assert len(output.sequences) == k
    # step 1: the prompt alone (a miss); steps 2..MAX_TOKENS: k beams, each one token past its parent
    assert [len(p) for p in submitted] == [len(prompt)] + [
        len(prompt) + s for s in range(1, MAX_TOKENS) for _ in range(k)
    ]
    expected_hits = sum(BLOCK * ((len(p) - 1) // BLOCK) for p in submitted[1:])
    stats = llm.stats()
    assert stats["prefix_cache_queries"] == sum(len(p) for p in submitted)
    assert stats["prefix_cache_hits"] == expected_hits > 0
    assert len(in_use) == MAX_TOKENS  # every step's beams ran in one engine step
    assert all(used == want for used, want in in_use), in_use
    assert_all_blocks_free(llm)
    # same tenant again: the prompt's full blocks are still cached; another tenant misses them
    engine.add_request, engine.runner.start = add_request, start
    llm.beam_search(prompt, BeamSearchParams(k, 1, ignore_eos=True), tenant_id="t1")
    assert llm.stats()["prefix_cache_hits"] == expected_hits + BLOCK * ((len(prompt) - 1) // BLOCK)
    llm.beam_search(prompt, BeamSearchParams(k, 1, ignore_eos=True), tenant_id="t2")
    assert llm.stats()["prefix_cache_hits"] == expected_hits + BLOCK * ((len(prompt) - 1) // BLOCK)
    assert_all_blocks_free(llm)


def test_same_answer_without_prefix_caching(eos_model, llm) -> None:
    path, model, _ = eos_model
    params = BeamSearchParams(4, MAX_TOKENS, length_penalty=1.0)
    uncached = make_llm(path, model, enable_prefix_caching=False)
    cached = llm.beam_search(PROMPTS, params)
    # Same sequences; scores equal up to float rounding (a prefix hit computes attention in another order).
    for a, b in zip(uncached.beam_search(PROMPTS, params), cached, strict=True):
        assert [(s.token_ids, s.text, s.finish_reason) for s in a.sequences] == [
            (s.token_ids, s.text, s.finish_reason) for s in b.sequences
        ]
        assert [s.score for s in a.sequences] == pytest.approx([s.score for s in b.sequences], abs=1e-5)
    assert uncached.stats()["prefix_cache_hits"] == 0
    assert_all_blocks_free(uncached)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(beam_width=0, max_tokens=4),
        dict(beam_width=11, max_tokens=4),  # needs 22 logprobs; the engine gives at most 20
        dict(beam_width=2.0, max_tokens=4),
        dict(beam_width=True, max_tokens=4),
        dict(beam_width=2, max_tokens=0),
        dict(beam_width=2, max_tokens=None),
        dict(beam_width=2, max_tokens=4, temperature=0.7),
        dict(beam_width=2, max_tokens=4, length_penalty=float("nan")),
        dict(beam_width=2, max_tokens=4, length_penalty="1"),
        dict(beam_width=2, max_tokens=4, early_stopping="always"),
        dict(beam_width=2, max_tokens=4, early_stopping=1),
        dict(beam_width=2, max_tokens=4, ignore_eos="yes"),
    ],
)
def test_bad_params_raise(kwargs) -> None:
    with pytest.raises(InvalidRequestError):
        BeamSearchParams(**kwargs)


def test_bad_requests_raise_and_leave_the_engine_usable(llm) -> None:
    params = BeamSearchParams(2, 3, ignore_eos=True)
    # Both runs start from an empty prefix cache: a hit computes the rest of a prompt in a smaller batch, which
    # may round differently, and the boosted EOS puts some of these beams within a rounding of a tie.
    assert llm.reset_prefix_cache()
    before = llm.beam_search(PROMPTS, params)
    counters = {k: llm.stats()[k] for k in ("prompt_tokens_total", "prefix_cache_queries")}
    with pytest.raises(InvalidRequestError, match="BeamSearchParams"):
        llm.beam_search(PROMPTS[0], SamplingParams(max_tokens=3))
    with pytest.raises(InvalidRequestError):
        llm.beam_search([PROMPTS[0], [VOCAB + 5]], params)  # second prompt bad: nothing queued for the first
    with pytest.raises(InvalidRequestError):
        llm.beam_search([], params)
    with pytest.raises(PromptTooLongError):
        llm.beam_search([PROMPTS[1], [7] * 600], params)
    assert {k: llm.stats()[k] for k in counters} == counters
    assert_all_blocks_free(llm)
    assert llm.reset_prefix_cache()
    assert llm.beam_search(PROMPTS, params) == before
