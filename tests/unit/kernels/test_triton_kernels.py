"""Each Triton kernel against the torch reference, run on CPU tensors by the Triton interpreter.

The module-scoped ``triton_interpreter`` fixture (conftest.py) switches the kernels to ``TRITON_INTERPRET=1``
(or, where this process cannot interpret Triton, the tests skip and one test reruns this file in a subprocess)
and every test forces ``PAGEWISE_KERNEL_BACKEND=triton``. Outputs are NaN-poisoned before each call (every
element must be written); cache slots outside any sequence's context are NaN too (they must never be read);
slots a kernel must not write are checked to be untouched. Sizes are tiny: the interpreter is slow.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pagewise.kernels as kernels
from pagewise.kernels import reference


@pytest.fixture(autouse=True)
def _interpreted_triton(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if request.function is test_interpreter_checks_in_subprocess:
        return
    request.getfixturevalue("triton_interpreter")
    monkeypatch.setenv("PAGEWISE_KERNEL_BACKEND", "triton")


def test_interpreter_checks_in_subprocess(interpreter_in_process: bool) -> None:
    """Where this process can't interpret Triton, run this whole file in one that can."""
    if interpreter_in_process:
        pytest.skip("the interpreter checks run in this process")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PAGEWISE_TRITON_INTERPRETER_SUBPROCESS": "1"}
    env.pop("PAGEWISE_KERNEL_BACKEND", None)
    cmd = [sys.executable, "-m", "pytest", str(Path(__file__)), "-q", "-p", "no:cacheprovider"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / expected.double().abs().max().clamp_min(1e-30))


def triton_attention():
    from pagewise.kernels import triton_attention as module  # imported after the fixture switched modes

    return module


ATTENTION_CASES = {
    # name: (seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    # decode only, GQA 1, head 64; lengths 1, block size - 1, block size, block size + 1, several blocks
    "decode_g1_d64_b16": ([1, 15, 16, 17, 50], [1, 1, 1, 1, 1], 2, 2, 64, 16),
    # mixed: decode, full prefill, chunk after a prefix, GQA 3, head 80 (padded to 128), block 8
    "mixed_g3_d80_b8": ([1, 7, 9, 30, 20, 12], [1, 1, 9, 5, 20, 1], 6, 2, 80, 8),
    # mixed, GQA 8, head 96, block 32
    "mixed_g8_d96_b32": ([33, 31, 70, 1], [1, 31, 6, 1], 8, 1, 96, 32),
    # prefill after a prefix hit, GQA 1, head 128
    "prefix_g1_d128_b16": ([40, 17], [24, 17], 2, 2, 128, 16),
}


def run_attention(batch, **kwargs) -> torch.Tensor:
    """Triton attention over NaN-poisoned unused cache slots, into a NaN-poisoned output."""
    key_cache, value_cache = batch.poisoned_caches()
    out = torch.full_like(batch.query, float("nan"))
    result = triton_attention().paged_attention(
        batch.query,
        key_cache,
        value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
        out=out,
        **kwargs,
    )
    assert result is out
    return out


def reference_attention(batch) -> torch.Tensor:
    return batch.attend(reference.paged_attention)


@pytest.mark.parametrize("splits", [None, 3], ids=["auto_splits", "3_splits"])
@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention_fp32(case: str, splits: int | None, paged_batch, monkeypatch) -> None:
    monkeypatch.setattr(triton_attention(), "_POISON_SCRATCH", True)
    batch = paged_batch(*ATTENTION_CASES[case], seed=len(case))
    # tile_n=16 so that even these short contexts really are cut into several splits
    out = run_attention(batch, num_splits=splits, tile_n=16 if splits else None)
    assert not out.isnan().any(), "some output element was not written"
    assert rel_err(out, reference_attention(batch)) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_paged_attention_half_precision(dtype: torch.dtype, paged_batch) -> None:
    batch = paged_batch(*ATTENTION_CASES["mixed_g3_d80_b8"], dtype=dtype, seed=7)
    out = run_attention(batch)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, reference_attention(batch)) <= 1e-2


def test_paged_attention_public_dispatch_uses_triton(paged_batch, monkeypatch) -> None:
    batch = paged_batch(*ATTENTION_CASES["decode_g1_d64_b16"], seed=3)
    calls = []
    real = triton_attention().paged_attention
    from pagewise.kernels import triton_ops

    monkeypatch.setattr(triton_ops, "paged_attention", lambda *a: calls.append(1) or real(*a))
    key_cache, value_cache = batch.poisoned_caches()
    out = kernels.paged_attention(
        batch.query,
        key_cache,
        value_cache,
        batch.block_tables,
        batch.seq_lens,
        batch.query_start_loc,
        batch.scale,
    )
    assert calls == [1]
    assert rel_err(out, reference_attention(batch)) <= 1e-5


def test_choose_num_splits() -> None:
    choose = triton_attention().choose_num_splits
    sms = 132
    assert choose(64 * 8, 4096, sms) == 1  # big decode batch already fills the GPU
    assert choose(8 * 8, 32768, sms) == 16  # few long sequences: ~8 programs per SM, a power of two
    assert choose(100, 32768, sms) == 8  # 1056 / 100 -> 11, rounded down
    assert choose(8 * 8, 512, sms) == 2  # never pieces shorter than 256 positions
    assert choose(1, 1 << 20, sms) == 64  # capped


@pytest.mark.parametrize(
    ("num_kv_heads", "head_dim", "block_size", "dtype", "cache_dtype"),
    [
        (2, 64, 16, torch.float32, torch.float32),
        (3, 80, 8, torch.float16, torch.float16),
        (1, 96, 32, torch.bfloat16, torch.bfloat16),
        (8, 128, 16, torch.float32, torch.bfloat16),  # converts on write
    ],
)
def test_reshape_and_cache(num_kv_heads, head_dim, block_size, dtype, cache_dtype) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    num_blocks, num_tokens = 4, 11
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    # strided views, as slices of a fused QKV projection would be
    qkv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=gen).to(dtype)
    key, value = qkv[:, 1], qkv[:, 2]
    key_cache = torch.full((num_blocks, num_kv_heads, block_size, head_dim), float("nan"), dtype=cache_dtype)
    value_cache = torch.full_like(key_cache, float("nan"))
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    reference.reshape_and_cache(key, value, expected_k, expected_v, slots)

    kernels.reshape_and_cache(key, value, key_cache, value_cache, slots)
    torch.testing.assert_close(key_cache, expected_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_v, rtol=0, atol=0, equal_nan=True)
    written = (~key_cache.isnan()).all(-1).all(1).flatten().nonzero().flatten()
    assert sorted(written.tolist()) == sorted(s for s in slots.tolist() if s >= 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_copy_blocks(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    num_layers, shape = 3, (9, 8, 2, 80)
    key_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    value_caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(num_layers)]
    expected_k = [c.clone() for c in key_caches]
    expected_v = [c.clone() for c in value_caches]
    mapping = torch.tensor([[0, 4], [7, 2], [3, 8]])
    reference.copy_blocks(expected_k, expected_v, mapping)

    kernels.copy_blocks(key_caches, value_caches, mapping)
    for got, want in zip(key_caches + value_caches, expected_k + expected_v, strict=True):
        assert torch.equal(got, want)
    kernels.copy_blocks(key_caches, value_caches, torch.empty(0, 2, dtype=torch.int64))  # no-op


@pytest.mark.parametrize(
    "row_slots",
    [
        [0, 1, 2, 0, 1, 2, 2],  # decode rows of three adapters
        [-1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, -1, 0, 0],  # a segment over one row tile
    ],
    ids=["interleaved", "long-segment"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_lora_shrink_expand(row_slots: list[int], dtype: torch.dtype) -> None:
    from pagewise.kernels import lora
    from pagewise.kernels.lora import LoraBatch

    gen = torch.Generator().manual_seed(len(row_slots))
    num_slots, rank, d_in, d_out = 3, 48, 40, 72  # rank and sizes off the tile sizes: masked edges
    lora_a = torch.randn(num_slots, rank, d_in, generator=gen).to(dtype)
    lora_b = torch.randn(num_slots, rank, d_out, generator=gen).to(dtype)
    x = torch.randn(len(row_slots), d_in, generator=gen).to(dtype)
    y = torch.randn(len(row_slots), d_out, generator=gen)
    batch = LoraBatch.build(row_slots, [0.5, 2.0, 1.5], torch.device("cpu"))
    expected = y.clone()
    lora.lora_add(expected, x, lora_a.float(), lora_b.float(), batch)  # the oracle in fp32

    kernels.lora_add(y, x, lora_a, lora_b, batch, torch.tensor([0, d_out]))
    assert rel_err(y, expected) < 1e-5
