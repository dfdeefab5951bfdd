"""Bad inputs: each gets its own error with a clear message, and a rejected request leaves the engine exactly as
it was (same stats, same queues, same free-block order, same prefix cache) and usable."""

from __future__ import annotations

import random

import pytest
import torch

from pagewise import LLM, EngineConfig, SamplingParams
from pagewise.engine.errors import InvalidConfigError, InvalidRequestError, PromptTooLongError
from pagewise.engine.loader import ModelNotFoundError
from pagewise.engine.model_runner import KVCache

BLOCK = 4
MAX_MODEL_LEN = 64
NUM_BLOCKS = 64
MAX_NUM_SEQS = 4
VOCAB = 49152
GREEDY = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


GOOD = _prompt(9, 0)


@pytest.fixture(scope="module")
def model_path(tiny_model):
    path, _ = tiny_model("validation-llama")
    return str(path)


@pytest.fixture(scope="module")
def per_block(tiny_model) -> int:
    _, model = tiny_model("validation-llama")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    return KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, head_dim, torch.float32)


@pytest.fixture(scope="module")
def llm(model_path, per_block) -> LLM:
    return LLM(model_path, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=NUM_BLOCKS * per_block,
               max_num_seqs=MAX_NUM_SEQS, progress=False, dtype="float32")


@pytest.fixture(scope="module")
def good_tokens(llm) -> list[int]:
    (out,) = llm.generate([GOOD], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3
    return out.outputs[0].token_ids


def snapshot(llm: LLM) -> tuple:
    engine = llm.engine
    return (
        llm.stats(),
        engine.has_unfinished_requests(),
        [b.block_id for b in engine.pool.free_queue],
        sorted(engine.pool.cached),
        len(engine.scheduler.waiting),
        len(engine.scheduler.running),
        dict(engine.scheduler.pending_forks),
    )


def assert_rejected(llm: LLM, good_tokens: list[int], call, error: type[Exception], match: str) -> Exception:
    """``call()`` raises ``error`` matching ``match``; the engine is unchanged and still generates correctly."""
    before = snapshot(llm)
    with pytest.raises(error, match=match) as info:
        call()
    assert snapshot(llm) == before
    (out,) = llm.generate([GOOD], GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == good_tokens
    assert not llm.engine.has_unfinished_requests()
    return info.value


# ---- prompts


def test_prompt_longer_than_max_model_len(llm, good_tokens) -> None:
    too_long = _prompt(MAX_MODEL_LEN, 1)
    err = assert_rejected(llm, good_tokens, lambda: llm.generate([too_long], GREEDY, use_tqdm=False),
                          PromptTooLongError, "prompt has 64 tokens; max_model_len is 64")
    assert isinstance(err, InvalidRequestError)
    assert (err.num_tokens, err.max_model_len) == (MAX_MODEL_LEN, MAX_MODEL_LEN)
    assert_rejected(llm, good_tokens, lambda: llm.engine.add_request("long", too_long + [5], GREEDY),
                    PromptTooLongError, "prompt has 65 tokens")
    assert_rejected(llm, good_tokens, lambda: llm.generate("hello " * 200, GREEDY, use_tqdm=False),
                    PromptTooLongError, "max_model_len is 64")


def test_prompt_one_below_max_model_len_generates_one_token(llm) -> None:
    (out,) = llm.generate([_prompt(MAX_MODEL_LEN - 1, 2)], SamplingParams(temperature=0, max_tokens=16,
                                                                            ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1
    assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("prompt", ["", []], ids=["str", "list"])
def test_empty_prompt(llm, good_tokens, prompt) -> None:
    assert_rejected(llm, good_tokens, lambda: llm.engine.add_request("empty", prompt, GREEDY),
                    InvalidRequestError, "prompt is empty")
    assert_rejected(llm, good_tokens, lambda: llm.generate([prompt], GREEDY, use_tqdm=False),
                    InvalidRequestError, "prompt is empty")


def test_empty_batch(llm, good_tokens) -> None:
    assert_rejected(llm, good_tokens, lambda: llm.generate([], GREEDY, use_tqdm=False),
                    InvalidRequestError, "no prompts")


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 1000, -1, 2.0, "7", True], ids=["vocab", "above", "negative", "float",
                                                                          "str", "bool"])
def test_token_id_out_of_vocab(llm, good_tokens, bad) -> None:
    assert_rejected(llm, good_tokens, lambda: llm.engine.add_request("oov", [5, bad, 6], GREEDY),
                    InvalidRequestError, rf"prompt token ids must be integers in \[0, {VOCAB}\)")


@pytest.mark.parametrize(
    ("params", "match"),
    [
        (SamplingParams(stop_token_ids=[3, VOCAB]),
         rf"stop_token_ids must be token ids in \[0, {VOCAB}\); got {VOCAB}"),
        (SamplingParams(logit_bias={VOCAB + 5: 1.0}), rf"logit_bias keys must be token ids in \[0, {VOCAB}\); got"),
    ],
    ids=["stop_token_ids", "logit_bias"],
)
def test_param_token_ids_out_of_vocab(llm, good_tokens, params, match) -> None:
    assert_rejected(llm, good_tokens, lambda: llm.engine.add_request("oov-param", GOOD, params),
                    InvalidRequestError, match)


def test_last_vocab_id_is_accepted(llm) -> None:
    (out,) = llm.generate([[5, VOCAB - 1]], GREEDY, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


@pytest.mark.parametrize("prompt", [None, 42, 3.5], ids=["none", "int", "float"])
def test_prompt_of_wrong_type(llm, good_tokens, prompt) -> None:
    """Not a str and not a sequence of ints: an InvalidRequestError, not a TypeError from deep inside."""
    assert_rejected(llm, good_tokens, lambda: llm.engine.add_request("typed", prompt, GREEDY),
                    InvalidRequestError, "prompt")


# ---- sampling parameters

NAN, INF = float("nan"), float("inf")
FLOATS = {  # every float field with its allowed range, as the error message states it
    "temperature": ">= 0",
    "top_p": r"in \(0, 1\]",
    "min_p": r"in \[0, 1\]",
    "presence_penalty": r"in \[-2, 2\]",
    "frequency_penalty": r"in \[-2, 2\]",
    "repetition_penalty": "> 0",
}
INTS = {"n": ">= 1", "max_tokens": ">= 1", "min_tokens": r"in \[0, 16\]", "top_k": ">= -1",
        "logprobs": r"in \[0, 20\]", "seed": r"in \[0, 18446744073709551615\]"}


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        *[(dict([(name, bad)]), rf"{name} must be a finite number {allowed}, got {bad!r}")
          for name, allowed in FLOATS.items() for bad in (NAN, INF, -INF)],
        *[(dict([(name, bad)]), rf"{name} must be a finite number {allowed}") for name, allowed in FLOATS.items()
          for bad in (True, "0.5", None)],
        *[(dict([(name, bad)]), rf"{name} must be an integer {allowed}") for name, allowed in INTS.items()
          for bad in (True, 2.0, "3")],
        (dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
        (dict(max_tokens=-3), "max_tokens must be an integer >= 1, got -3"),
        (dict(n=0), "n must be an integer >= 1, got 0"),
        (dict(temperature=-0.1), "temperature must be a finite number >= 0, got -0.1"),
        (dict(top_p=0.0), r"top_p must be a finite number in \(0, 1\], got 0.0"),
        (dict(top_p=1.01), r"top_p must be a finite number in \(0, 1\], got 1.01"),
        (dict(top_p=-0.5), r"top_p must be a finite number in \(0, 1\]"),
        (dict(top_k=-2), r"top_k must be an integer >= -1 \(0 or -1 disables it\), got -2"),
        (dict(min_p=-0.01), r"min_p must be a finite number in \[0, 1\], got -0.01"),
        (dict(min_p=1.5), r"min_p must be a finite number in \[0, 1\], got 1.5"),
        (dict(logprobs=-1), r"logprobs must be an integer in \[0, 20\], got -1"),
        (dict(logprobs=21), r"logprobs must be an integer in \[0, 20\], got 21"),
        (dict(presence_penalty=2.5), r"presence_penalty must be a finite number in \[-2, 2\], got 2.5"),
        (dict(frequency_penalty=-2.5), r"frequency_penalty must be a finite number in \[-2, 2\]"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0, got 0.0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be a finite number > 0"),
        (dict(min_tokens=-1), r"min_tokens must be an integer in \[0, 16\] \(at most max_tokens\), got -1"),
        (dict(min_tokens=5, max_tokens=4), r"min_tokens must be an integer in \[0, 4\] \(at most max_tokens\)"),
        (dict(seed=-1), r"seed must be an integer in \[0, 18446744073709551615\], got -1"),
        (dict(seed=2**64), r"seed must be an integer in \[0, 18446744073709551615\]"),
        (dict(seed=2**64 - 2, n=3), r"seed \+ n - 1 must be <= 18446744073709551615"),
        (dict(stop=""), "stop must be a non-empty string"),
        (dict(stop=["ok", ""]), "stop must be a non-empty string"),
        (dict(stop=[3]), "stop must be a non-empty string"),
        (dict(stop=5), "stop must be a non-empty string"),
        (dict(stop=["s"] * 17), "stop has 17 strings; at most 16 are allowed"),
        (dict(stop=["x" * 257]), "stop strings must be at most 256 characters, got one of 257"),
        (dict(stop_token_ids=[-1]), "stop_token_ids must be a list of non-negative integers"),
        (dict(stop_token_ids=["a"]), "stop_token_ids must be a list of non-negative integers"),
        (dict(stop_token_ids=[True]), "stop_token_ids must be a list of non-negative integers"),
        (dict(stop_token_ids=7), "stop_token_ids must be a list of non-negative integers"),
        (dict(stop_token_ids=list(range(65))), "stop_token_ids has 65 ids; at most 64 are allowed"),
        (dict(logit_bias=[1, 2]), "logit_bias must be a dict"),
        (dict(logit_bias={True: 1.0}), r"logit_bias keys must be token ids \(integers >= 0\), got True"),
        (dict(logit_bias={-1: 1.0}), r"logit_bias keys must be token ids \(integers >= 0\), got -1"),
        (dict(logit_bias={"5": 1.0}), r"logit_bias keys must be token ids"),
        (dict(logit_bias={5: 100.5}), r"logit_bias\[5\] must be a finite number in \[-100, 100\], got 100.5"),
        (dict(logit_bias={5: NAN}), r"logit_bias\[5\] must be a finite number in \[-100, 100\], got nan"),
        (dict(logit_bias={5: -INF}), r"logit_bias\[5\] must be a finite number"),
        (dict(logit_bias={5: "1"}), r"logit_bias\[5\] must be a finite number"),
        (dict(logit_bias=dict.fromkeys(range(301), 1.0)), "logit_bias has 301 entries; at most 300 are allowed"),
        (dict(ignore_eos=1), "ignore_eos must be a bool, got 1"),
        (dict(skip_special_tokens="no"), "skip_special_tokens must be a bool"),
        (dict(include_stop_str_in_output=None), "include_stop_str_in_output must be a bool"),
    ],
    ids=repr,
)
def test_bad_sampling_params(kwargs, match) -> None:
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [dict(top_p=1.0), dict(top_p=1e-9), dict(top_k=-1), dict(top_k=0), dict(min_p=0.0), dict(min_p=1.0),
     dict(logprobs=0), dict(logprobs=20), dict(temperature=0.0), dict(temperature=1), dict(max_tokens=1),
     dict(stop="x"), dict(stop=("a", "b")), dict(stop=["s" * 256] * 16), dict(stop_token_ids=[0]),
     dict(stop_token_ids=list(range(64))), dict(presence_penalty=-2.0), dict(frequency_penalty=2),
     dict(repetition_penalty=1e-3), dict(repetition_penalty=50.0), dict(min_tokens=16), dict(min_tokens=0),
     dict(seed=0), dict(seed=2**64 - 1), dict(seed=2**64 - 3, n=3), dict(logit_bias={}),
     dict(logit_bias={0: -100, 49151: 100.0}), dict(logit_bias=dict.fromkeys(range(300), 0.5)),
     dict(include_stop_str_in_output=True)],
    ids=repr,
)
def test_boundary_sampling_params_are_accepted(kwargs) -> None:
    params = SamplingParams(**kwargs)
    assert params.top_k >= 0  # -1 is normalised to 0 ("disabled")
    for i in range(params.n):  # every sample's seed is a valid torch seed
        sample = params.for_sample(i)
        if sample.seed is not None:
            torch.Generator().manual_seed(sample.seed)


def test_sampling_params_keep_their_own_copies() -> None:
    """Mutating the caller's list or dict after construction cannot smuggle an invalid value in."""
    ids, bias = [5], {5: 1.0}
    params = SamplingParams(stop_token_ids=ids, logit_bias=bias)
    ids.append(-1)
    bias[5] = float("nan")
    assert params.stop_token_ids == [5] and params.logit_bias == {5: 1.0}


@pytest.mark.parametrize(("temperature", "greedy"), [(0, True), (1e-6, True), (9.99e-6, True), (1e-5, False)])
def test_tiny_temperatures_are_greedy(temperature, greedy) -> None:
    assert SamplingParams(temperature=temperature).greedy is greedy


# ---- engine-level request checks


def test_request_needing_more_kv_than_the_whole_cache(model_path, per_block) -> None:
    llm = LLM(model_path, block_size=BLOCK, max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=8 * per_block,
              progress=False, dtype="float32")  # 8 blocks = 32 token slots, less than max_model_len
    prompt = _prompt(20, 3)
    before = snapshot(llm)
    with pytest.raises(InvalidRequestError, match="needs up to 33 tokens of KV cache but the whole cache holds 32"):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=13), use_tqdm=False)
    assert snapshot(llm) == before
    # Exactly the whole cache is fine, and finishes (no hang, no preemption loop).
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 12
    stats = llm.stats()
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"] == 8


def test_n_greater_than_max_num_seqs(llm, good_tokens) -> None:
    params = SamplingParams(n=MAX_NUM_SEQS + 1, temperature=0.5, max_tokens=2)
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD], params, use_tqdm=False),
                    InvalidRequestError, "n=5 exceeds max_num_seqs=4")
    (out,) = llm.generate([GOOD], SamplingParams(n=MAX_NUM_SEQS, temperature=0, max_tokens=3, ignore_eos=True),
                          use_tqdm=False)
    assert [c.token_ids for c in out.outputs] == [good_tokens] * MAX_NUM_SEQS


def test_duplicate_request_id(llm, good_tokens) -> None:
    engine = llm.engine
    before_prompt_tokens = llm.stats()["prompt_tokens_total"]
    engine.add_request("dup", GOOD, GREEDY)
    after_first = snapshot(llm)
    with pytest.raises(InvalidRequestError, match="request id 'dup' is already in use"):
        engine.add_request("dup", _prompt(5, 4), GREEDY)
    assert snapshot(llm) == after_first
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.prompt_token_ids, o.outputs[0].token_ids) for o in finished] == [
        ("dup", GOOD, good_tokens)
    ]
    assert llm.stats()["prompt_tokens_total"] == before_prompt_tokens + len(GOOD)
    engine.add_request("dup", GOOD, GREEDY)  # a finished request's id is free again
    while engine.has_unfinished_requests():
        engine.step()


def test_batch_with_one_bad_prompt_queues_none(llm, good_tokens) -> None:
    other = _prompt(6, 5)
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD, [], other], GREEDY, use_tqdm=False),
                    InvalidRequestError, "prompt is empty")
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD, other, _prompt(MAX_MODEL_LEN, 6)], GREEDY,
                                                           use_tqdm=False),
                    PromptTooLongError, "max_model_len is 64")
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD, [1, VOCAB]], GREEDY, use_tqdm=False),
                    InvalidRequestError, "prompt token ids")
    params = [GREEDY, SamplingParams(n=MAX_NUM_SEQS + 1, max_tokens=2)]
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD, other], params, use_tqdm=False),
                    InvalidRequestError, "exceeds max_num_seqs")
    assert_rejected(llm, good_tokens, lambda: llm.generate([GOOD, other], [GREEDY], use_tqdm=False),
                    InvalidRequestError, "got 1 sampling params for 2 prompts")


# ---- engine construction


def test_unknown_model_path(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="no-such-model.* not found"):
        LLM(str(missing), kv_cache_memory_bytes=1 << 20, progress=False, dtype="float32")
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM(str(tmp_path), kv_cache_memory_bytes=1 << 20, progress=False)  # a directory without config.json
    with pytest.raises(ModelNotFoundError, match="not found"):
        LLM("no-such-model-name", kv_cache_memory_bytes=1 << 20, progress=False, dtype="float32")


def test_kv_budget_too_small_for_one_block(model_path, per_block) -> None:
    with pytest.raises(
        InvalidConfigError, match=f"too small: one block of 4 tokens in all 2 layers needs {per_block:,} bytes"
    ):
        LLM(model_path, block_size=BLOCK, kv_cache_memory_bytes=per_block - 1, progress=False, dtype="float32")
    llm = LLM(
        model_path, block_size=BLOCK, kv_cache_memory_bytes=per_block, max_model_len=4, progress=False, dtype="float32"
    )
    assert llm.stats()["kv_blocks_total"] == 1
    (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(block_size=3), "block_size must be a power of two in \\[1, 128\\], got 3"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=256), "block_size"),
        (dict(preemption_mode="lru"), "preemption_mode must be 'recompute' or 'swap', got 'lru'"),
        (dict(dtype="float64"), "dtype must be one of .*got 'float64'"),
        (dict(dtype="fp32"), "dtype"),
        (dict(device="tpu"), "device must be 'cpu' or 'cuda\\[:N\\]', got 'tpu'"),
        (dict(max_num_seqs=0), "max_num_seqs must be >= 1"),
        (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be >= 1"),
        (dict(fair_max_num_batched_tokens=0), "fair_max_num_batched_tokens must be >= 1"),
        (dict(interrupt_max_num_batched_tokens=0), "interrupt_max_num_batched_tokens must be >= 1"),
        (dict(max_interrupts_per_step=-1), "max_interrupts_per_step must be >= 0"),
        (dict(max_model_len=1), "max_model_len must be >= 2"),
        (dict(kv_cache_memory_bytes=0), "kv_cache_memory_bytes must be > 0"),
        (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in \\(0, 1\\]"),
        (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization"),
        (dict(swap_space_bytes=-1), "swap_space_bytes must be >= 0"),
        (dict(block_size=True), "block_size must be a power of two"),
        (dict(max_num_seqs="4"), "max_num_seqs must be >= 1, got 4"),
        (dict(max_model_len=64.0), "max_model_len must be >= 2"),
        (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be in"),
        (dict(gpu_memory_utilization=True), "gpu_memory_utilization must be in"),
    ],
    ids=repr,
)
def test_bad_engine_args(model_path, kwargs, match) -> None:
    with pytest.raises(InvalidConfigError, match=match):
        EngineConfig(model=model_path, **kwargs)
    with pytest.raises(InvalidConfigError, match=match):
        LLM(model_path, progress=False, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_device_without_cuda(model_path, device) -> None:
    with pytest.raises(InvalidConfigError, match=f"device '{device}' requested but CUDA is not available"):
        LLM(model_path, device=device, progress=False, dtype="float32")


def test_max_model_len_beyond_model_context(model_path) -> None:
    with pytest.raises(InvalidConfigError, match="max_model_len 1,024 exceeds the model's context length 512"):
        LLM(model_path, max_model_len=1024, kv_cache_memory_bytes=1 << 20, progress=False, dtype="float32")


def test_the_shared_budget_defaults_to_the_full_budget_and_never_exceeds_it() -> None:
    assert EngineConfig().resolve_fair_max_num_batched_tokens(2048, 1024) == 2048
    assert EngineConfig().resolve_fair_max_num_batched_tokens(256, 1024) == 256
    assert EngineConfig(fair_max_num_batched_tokens=1024).resolve_fair_max_num_batched_tokens(2048, 1024) == 1024
    assert (
        EngineConfig(fair_max_num_batched_tokens=4096, dtype="float32").resolve_fair_max_num_batched_tokens(2048, 1024)
        == 2048
    )
    assert (
        EngineConfig(enable_chunked_prefill=False, dtype="float32").resolve_fair_max_num_batched_tokens(2048, 1024)
        == 2048
    )
    with pytest.raises(InvalidConfigError, match="fair_max_num_batched_tokens \\(256\\) is smaller than max_model_len"):
        EngineConfig(
            fair_max_num_batched_tokens=256, enable_chunked_prefill=False, dtype="float32"
        ).resolve_fair_max_num_batched_tokens(2048, 1024)


def test_token_budget_below_max_model_len_without_chunked_prefill(model_path) -> None:
    with pytest.raises(InvalidConfigError, match="enable chunked prefill or raise the budget"):
        LLM(
            model_path,
            max_model_len=64,
            max_num_batched_tokens=32,
            enable_chunked_prefill=False,
            kv_cache_memory_bytes=1 << 20,
            progress=False,
            dtype="float32",
        )
