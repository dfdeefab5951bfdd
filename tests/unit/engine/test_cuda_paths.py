"""The CUDA-only paths: swap copies that land before they are read, and the KV budget as a share of the device's
total memory (vLLM's ``gpu_memory_utilization``). The arithmetic and the profiling forward pass run everywhere;
the rest runs where CUDA is present and is skipped elsewhere."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from pagewise import LLM, SamplingParams
from pagewise.engine.errors import InvalidConfigError
from pagewise.engine.kv_budget import DeviceMemory, cuda_kv_cache_bytes
from pagewise.engine.loader import load_model
from pagewise.engine.model_runner import KVCache, profile_forward
from pagewise.engine.models.llama import LlamaForCausalLM
from pagewise.kernels import swap_blocks

BLOCK = 4
VOCAB = 49152
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GIB = 1024**3


# ---- everywhere


def test_kv_budget_is_a_share_of_total_memory_minus_what_this_process_took() -> None:
    start, after = DeviceMemory(free=90 * GIB, total=100 * GIB), DeviceMemory(free=60 * GIB, total=100 * GIB)
    # 80 GiB share - (30 GiB taken since start-up + 5 GiB activations); others' 10 GiB are not charged
    assert cuda_kv_cache_bytes(0.8, start, after, 5 * GIB) == 45 * GIB


def test_kv_budget_errors_are_clear() -> None:
    start = DeviceMemory(free=90 * GIB, total=100 * GIB)
    with pytest.raises(InvalidConfigError, match=r"gpu_memory_utilization=0.95 asks for .* were free at start-up"):
        cuda_kv_cache_bytes(0.95, start, start, 0)
    with pytest.raises(InvalidConfigError, match=r"gpu_memory_utilization=0.1 gives this engine .* already take"):
        cuda_kv_cache_bytes(0.1, start, DeviceMemory(free=81 * GIB, total=100 * GIB), 1 * GIB)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("cuda-paths-llama")


def test_profile_forward_runs_the_largest_step_without_touching_a_cache(tiny) -> None:
    loaded = load_model(str(tiny[0]), dtype=torch.float32, progress=False)
    model = LlamaForCausalLM(loaded.arch, 64)
    model.load_hf_weights(loaded.weights)
    profile_forward(model.eval(), num_tokens=150, max_seq_len=64, num_sample_rows=8, block_size=BLOCK)  # 64+64+22


# ---- CUDA


def _per_block(model) -> int:
    cfg = model.config
    return KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads,
                                   cfg.hidden_size // cfg.num_attention_heads, torch.float32)


@needs_cuda
def test_swap_copies_have_landed_when_swap_blocks_returns() -> None:
    """Big blocks so that an unsynchronized device-to-host copy would still be in flight when read."""
    device = torch.randn(256, 8, 64, 128, device="cuda")
    host = torch.zeros(256, 8, 64, 128, pin_memory=True)
    mapping = torch.tensor([[i, 255 - i] for i in range(256)])
    swap_blocks(device, host, mapping)
    assert torch.equal(host, device.flip(0).cpu())
    back = torch.zeros_like(device)
    swap_blocks(host, back, mapping)
    assert torch.equal(back, device)


@needs_cuda
def test_swap_preemption_on_cuda_keeps_greedy_outputs(tiny) -> None:
    path, model = tiny
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in (3, 9, 17, 30, 5, 12)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    roomy = LLM(str(path), device="cuda", block_size=BLOCK, kv_cache_memory_bytes=256 * _per_block(model),
                progress=False, dtype="float32")
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    del roomy
    tight = LLM(str(path), device="cuda", block_size=BLOCK, kv_cache_memory_bytes=12 * _per_block(model),
                swap_space_bytes=64 * _per_block(model), preemption_mode="swap", progress=False, dtype="float32")
    got = [o.outputs[0].token_ids for o in tight.generate(prompts, params, use_tqdm=False)]
    assert tight.stats()["num_swapped_out_blocks"] > 0
    assert got == want


def _fresh_device() -> None:
    gc.collect()
    torch.cuda.empty_cache()


@needs_cuda
def test_gpu_memory_utilization_is_a_share_of_total_memory(tiny) -> None:
    """One more GiB of share is one more GiB of KV cache (the weights and activations are charged once), and the
    engine takes no more of the device than its share."""
    path, model = tiny
    total = torch.cuda.mem_get_info()[1]
    warm = LLM(str(path), device="cuda", block_size=BLOCK, kv_cache_memory_bytes=64 * _per_block(model),
               progress=False, dtype="float32")  # CUDA libraries and kernels load once per process: not measured
    warm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    del warm
    kv_bytes = []
    for share in (3 * GIB, 4 * GIB):
        _fresh_device()
        free_before = torch.cuda.mem_get_info()[0]
        # Enough sequences that the measured budget, not the "useful blocks" cap, sizes the cache.
        llm = LLM(
            str(path),
            device="cuda",
            block_size=BLOCK,
            gpu_memory_utilization=share / total,
            max_num_seqs=16384,
            progress=False,
            dtype="float32",
        )
        assert free_before - torch.cuda.mem_get_info()[0] <= share
        assert llm.engine.num_blocks < 16384 * (512 // BLOCK)
        kv_bytes.append(llm.engine.num_blocks * _per_block(model))
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 4
        del llm
    assert abs((kv_bytes[1] - kv_bytes[0]) - GIB) < 0.05 * GIB
    _fresh_device()


@needs_cuda
def test_gpu_memory_utilization_too_small_for_the_weights(tiny) -> None:
    _fresh_device()
    with pytest.raises(InvalidConfigError, match="already take"):
        LLM(str(tiny[0]), device="cuda", block_size=BLOCK, gpu_memory_utilization=1e-6, progress=False, dtype="float32")
    _fresh_device()
