"""The compiled CPU kernels (``cpu_ops``) against the dense fp64 oracle and the torch reference.

Caches are NaN-poisoned outside the sequences' context, so a kernel that reads a slot it must not fails. The
library is built here if ``make install`` has not built it yet; without a C++ compiler the module is skipped
(the engine then runs the reference, which ``test_missing_library_falls_back`` covers).
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from pagewise import kernels
from pagewise.kernels import cpu_build, cpu_ops, gemm, reference
from tests.unit.kernels.test_reference import CASES, check_against_dense


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    if cpu_build.compiler() is None:
        pytest.skip("no C++ compiler: the compiled CPU kernels cannot be built here")
    cpu_build.build()
    cpu_ops.available.cache_clear()
    assert cpu_ops.available()


def run(batch) -> torch.Tensor:
    """The compiled path on NaN-poisoned caches."""
    return batch.attend(cpu_ops.paged_attention, *batch.poisoned_caches())


@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_dense(case: str, paged_batch) -> None:
    batch = paged_batch(*CASES[case], seed=hash(case) % 1000)
    check_against_dense(batch, run(batch))


@pytest.mark.parametrize("seed", range(16))
def test_decode_random_shapes_match_reference(seed: int, paged_batch) -> None:
    """Decode-only batches (the compiled path end to end) on random GQA shapes and lengths."""
    rng = random.Random(seed)
    num_kv_heads, group = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 8])
    block_size = rng.choice([8, 16, 32])
    seq_lens = [rng.randint(1, 5 * block_size) for _ in range(rng.randint(1, 40))]
    batch = paged_batch(
        seq_lens,
        [1] * len(seq_lens),
        num_kv_heads * group,
        num_kv_heads,
        rng.choice([64, 80, 128]),
        block_size,
        seed=seed,
    )
    out = run(batch)
    check_against_dense(batch, out)
    expected = batch.attend(reference.paged_attention)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_reshape_and_cache_matches_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    shape = (7, 3, 16, 64)
    slots = torch.tensor([5, -1, 17, 111, 40, -1, 0])
    # a strided key/value, as the QKV projection's split gives
    qkv = torch.randn(len(slots), 3, 3 * 64, generator=gen)
    key, value = qkv[..., 64:128], qkv[..., 128:]
    expected = [torch.full(shape, float("nan")) for _ in range(2)]
    actual = [c.clone() for c in expected]
    reference.reshape_and_cache(key, value, *expected, slots)
    cpu_ops.reshape_and_cache(key, value, *actual, slots)
    for got, want in zip(actual, expected, strict=True):
        torch.testing.assert_close(got, want, equal_nan=True, rtol=0, atol=0)


def rounds_query_to_bf16(head_dim: int, group: int) -> bool:
    """Whether the compiled decode over a bf16 cache takes its AVX512-BF16 path on this CPU for these shapes: it
    then computes the attention of the scaled query rounded to bf16 (products of two bf16 values, exact in
    float32)."""
    return bf16_dot_products() and head_dim % 32 == 0 and head_dim <= 256 and group <= 8


def bf16_dot_products() -> bool:
    flags = gemm.cpu_flags()
    return "avx512_bf16" in flags and "avx512bw" in flags


def bf16_decode_rows(batch) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """Where the compiled decode over a bf16 cache runs (on AMX tiles or with AVX512-BF16: both round the scaled
    query and each probability to bf16, as bf16 attention does), each decode row's expected output and the slack
    it is allowed: the scaled query rounded to bf16 against the widened cache, the softmax rounded to bf16, the
    value sum exact (float64 here). A probability within the kernel's float32 error (3e-5 relative, the scores'
    sums and its exp) of a bf16 rounding midpoint may round either way, so each such one is allowed one bf16 step
    times its value row."""
    num_heads, num_kv_heads, head_dim = batch.query.shape[1], batch.key_cache.shape[1], batch.query.shape[2]
    group, block_size = num_heads // num_kv_heads, batch.key_cache.shape[2]
    if not rounds_query_to_bf16(head_dim, group):
        return {}
    widened = [cache.bfloat16().double() for cache in (batch.key_cache, batch.value_cache)]
    starts, rows = batch.query_start_loc.tolist(), {}
    for s in range(len(starts) - 1):
        if starts[s + 1] - starts[s] != 1:
            continue
        length = int(batch.seq_lens[s])
        blocks = batch.block_tables[s, : -(-length // block_size)].long()
        keys, values = (c[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length] for c in widened)
        query = (batch.query[starts[s]] * batch.scale).bfloat16().double().view(num_kv_heads, group, head_dim)
        exact = torch.softmax(query @ keys.transpose(1, 2), dim=-1)
        rounded, either_way = bf16_rounding(exact)
        rows[starts[s]] = (
            (rounded @ values).reshape(num_heads, head_dim).float(),
            (either_way @ values.abs()).reshape(num_heads, head_dim).float(),
        )
    return rows


def bf16_rounding(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights in [0, 1] (float64) rounded to bf16, and for each the one bf16 step it may round the other way
    by: nonzero only within the kernels' float32 error (3e-5 relative, the scores' sums and their exp) of a
    rounding midpoint."""
    rounded = exact.float().bfloat16().double()
    step = torch.exp2(torch.floor(torch.log2(exact.clamp_min(1e-30))) - 7)  # a bf16 step at the weight
    near_midpoint = (step / 2 - (exact - rounded).abs()) < 3e-5 * exact
    return rounded, step * near_midpoint


PREFILL_KEYS = 256  # keys per online-softmax pass of the compiled prefill (its PREFILL_KEYS)


def bf16_prefill_rows(batch) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:  # noqa: ANN001
    """Where prefill chunks run through ``paged_attention_mixed``, each chunk row's expected output and slack:
    the scaled query rounded to bf16 against the widened cache; per pass of ``PREFILL_KEYS`` keys, the running
    peak raised to the pass's highest score the row sees (what was summed before scaled down with it), each
    weight exp(score - peak) rounded to bf16 against its value row, the normaliser the sum of the unrounded
    weights — the compiled online softmax, exact (float64) here, with ``bf16_rounding``'s slack."""
    num_heads, num_kv_heads, head_dim = batch.query.shape[1], batch.key_cache.shape[1], batch.query.shape[2]
    group, block_size = num_heads // num_kv_heads, batch.key_cache.shape[2]
    widened = [cache.bfloat16().double() for cache in (batch.key_cache, batch.value_cache)]
    starts, rows = batch.query_start_loc.tolist(), {}
    for s in range(len(starts) - 1):
        q_len, length = starts[s + 1] - starts[s], int(batch.seq_lens[s])
        if q_len == 1:
            continue
        blocks = batch.block_tables[s, : -(-length // block_size)].long()
        keys, values = (
            c[blocks].transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :length].repeat_interleave(group, 0)
            for c in widened
        )
        query = (batch.query[starts[s] : starts[s + 1]] * batch.scale).bfloat16().double().transpose(0, 1)
        scores = query @ keys.transpose(1, 2)  # heads x q_len x length
        positions = torch.arange(length - q_len, length)
        scores[:, torch.arange(length)[None, :] > positions[:, None]] = -torch.inf
        peak = torch.full((num_heads, q_len, 1), -torch.inf, dtype=torch.float64)
        total = torch.zeros_like(peak)
        out, slack = torch.zeros_like(query), torch.zeros_like(query)
        for k0 in range(0, length, PREFILL_KEYS):
            passed = scores[..., k0 : k0 + PREFILL_KEYS]
            new_peak = torch.maximum(peak, passed.amax(-1, keepdim=True))
            shrink = torch.where(total > 0, torch.exp(peak - new_peak), 0.0)
            weights = torch.exp(passed - new_peak)
            rounded, either_way = bf16_rounding(weights)
            out = out * shrink + rounded @ values[:, k0 : k0 + PREFILL_KEYS]
            slack = slack * shrink + either_way @ values[:, k0 : k0 + PREFILL_KEYS].abs()
            total, peak = total * shrink + weights.sum(-1, keepdim=True), new_peak
        for i in range(q_len):
            rows[starts[s] + i] = (
                (out[:, i] / total[:, i]).float(),
                (slack[:, i] / total[:, i]).float(),
            )
    return rows


def assert_close_over_bf16_cache(  # noqa: ANN001
    out: torch.Tensor, batch, expected: torch.Tensor, atol: float, prefill_compiled: bool = False
) -> None:
    """``out`` within ``atol`` + 1e-5 relative of ``expected``, its decode rows compared to ``bf16_decode_rows``
    (with their slack) where the compiled bf16 decode runs, and its prefill rows to ``bf16_prefill_rows`` where
    ``prefill_compiled`` (the step ran through ``paged_attention_mixed``)."""
    expected, slack = expected.clone(), torch.zeros_like(expected)
    modelled = {**bf16_decode_rows(batch), **(bf16_prefill_rows(batch) if prefill_compiled else {})}
    for row, (want, allowed) in modelled.items():
        expected[row], slack[row] = want, allowed
    assert torch.isfinite(out).all()
    excess = (out - expected).abs() - (atol + 1e-5 * expected.abs() + slack)
    assert (excess <= 0).all(), f"{int((excess > 0).sum())} of {out.numel()} off, worst by {excess.max().item():.3g}"


def expected_over_bf16_cache(batch) -> torch.Tensor:  # noqa: ANN001
    """The reference over the batch's caches in bf16, with the queries rounded as the compiled path rounds them
    here: the decode rows' where the decode kernel takes its AVX512-BF16 path, and every row where prefill chunks
    run compiled too (``cpu_ops.mixed_attention_runs``), which then computes in float32 over the widened cache;
    otherwise prefill rows run the reference's own attention, which does not round."""
    num_heads, num_kv_heads, head_dim = batch.query.shape[1], batch.key_cache.shape[1], batch.query.shape[2]
    clean = [cache.bfloat16() for cache in (batch.key_cache, batch.value_cache)]
    if mixed_steps_compiled(batch, clean[0]):
        return bf16_dot_reference(batch)
    query = batch.query.clone()
    if rounds_query_to_bf16(head_dim, num_heads // num_kv_heads):
        starts = batch.query_start_loc.tolist()
        for s in range(len(starts) - 1):
            if starts[s + 1] - starts[s] == 1:
                query[starts[s]] = (query[starts[s]] * batch.scale).bfloat16().float() / batch.scale
    return reference.paged_attention(
        query, *clean, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
    )


def bf16_dot_reference(batch) -> torch.Tensor:  # noqa: ANN001
    """What the AVX512-BF16 attention computes for every row: the float32 reference of the scaled query rounded
    to bf16, over the cache rounded to bf16 and widened back."""
    query = (batch.query * batch.scale).bfloat16().float() / batch.scale
    widened = [cache.bfloat16().float() for cache in (batch.key_cache, batch.value_cache)]
    return reference.paged_attention(
        query, *widened, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale
    )


def mixed_steps_compiled(batch, bf16_cache: torch.Tensor) -> bool:  # noqa: ANN001
    """Whether the batch, holding a prefill chunk, runs through ``paged_attention_mixed`` here."""
    decode_only = batch.query_start_loc[-1].item() == len(batch.seq_lens)
    return not decode_only and cpu_ops.mixed_attention_runs(batch.query, bf16_cache)


@pytest.mark.skipif(not bf16_dot_products(), reason="paged_attention_mixed needs AVX512-BF16")
@pytest.mark.parametrize("seed", range(16))
def test_mixed_steps_over_a_bf16_cache_random_shapes(seed: int, paged_batch) -> None:
    """The compiled mixed op (decodes and prefill chunks of one step) against the float32 reference of the
    scaled query rounded to bf16 over the widened cache, on NaN-poisoned caches: chunks longer than a tile of
    query tokens and than a pass of keys (so the running peak is rescaled), chunks after a cached prefix,
    decodes beside them, block sizes from 1 to 64 and the head dims it takes."""
    rng = random.Random(200 + seed)
    num_kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 3, 4, 8])
    block_size = rng.choice([1, 4, 16, 32, 64])
    seq_lens, q_lens = [], []
    for _ in range(rng.randint(1, 6)):
        n = rng.choice([rng.randint(2, 40), rng.randint(33, 300), rng.randint(250, 600)])
        seq_lens.append(n)
        q_lens.append(rng.choice([1, n, rng.randint(2, n)]))  # decode, whole prompt, chunk after a prefix
    head_dim = rng.choice([32, 64, 96, 128, 160, 256])
    batch = paged_batch(seq_lens, q_lens, num_kv_heads * group, num_kv_heads, head_dim, block_size, seed=seed)
    caches = [cache.bfloat16() for cache in batch.poisoned_caches()]
    out = batch.attend(torch.ops.pagewise_cpu.paged_attention_mixed, *caches)
    assert_close_over_bf16_cache(out, batch, bf16_dot_reference(batch), atol=2e-5, prefill_compiled=True)


@pytest.mark.skipif(not bf16_dot_products(), reason="paged_attention_mixed needs AVX512-BF16")
def test_mixed_op_refuses_what_it_does_not_take(paged_batch) -> None:
    batch = paged_batch([40, 9], [40, 1], 6, 2, 64, 16)
    op = torch.ops.pagewise_cpu.paged_attention_mixed
    with pytest.raises(RuntimeError, match="bf16 cache"):
        batch.attend(op)  # a float32 cache
    bf16 = [cache.bfloat16() for cache in (batch.key_cache, batch.value_cache)]
    with pytest.raises(RuntimeError, match="query rows must lie in its context"):
        op(batch.query, *bf16, batch.block_tables, torch.tensor([30, 9], dtype=torch.int32), batch.query_start_loc,
           batch.scale)  # fmt: skip
    odd = paged_batch([20], [20], 2, 1, 80, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        odd.attend(op, *(cache.bfloat16() for cache in (odd.key_cache, odd.value_cache)))


@pytest.mark.parametrize("case", sorted(CASES))
def test_attention_over_a_bf16_cache_matches_reference(case: str, paged_batch) -> None:
    """fp32 queries over a bf16 cache (``dtype=auto``'s): the compiled path reads the cache as the reference
    does (widened to fp32; with AVX512-BF16 the decode rows' scaled query is rounded to bf16 once), so the two
    agree to fp32 rounding, decode and prefill rows alike."""
    batch = paged_batch(*CASES[case], seed=hash(case) % 1000 + 1)
    caches = [cache.bfloat16() for cache in batch.poisoned_caches()]  # NaN stays NaN: unused slots still poison
    out = batch.attend(cpu_ops.paged_attention, *caches)
    assert out.dtype == torch.float32
    assert_close_over_bf16_cache(
        out, batch, expected_over_bf16_cache(batch), atol=1e-5, prefill_compiled=mixed_steps_compiled(batch, caches[0])
    )


@pytest.mark.parametrize("seed", range(12))
def test_decode_over_a_bf16_cache_random_shapes(seed: int, paged_batch) -> None:
    """Decode batches over bf16 caches on random GQA shapes, block sizes and lengths (contexts that end inside
    a block and inside a run of sixteen tokens; head dims on and off the AVX512-BF16 path)."""
    rng = random.Random(100 + seed)
    num_kv_heads, group = rng.choice([1, 2, 3]), rng.choice([1, 3, 4, 8, 9])
    block_size = rng.choice([4, 8, 16, 32, 64])
    seq_lens = [rng.randint(1, 6 * block_size) for _ in range(rng.randint(1, 24))]
    batch = paged_batch(
        seq_lens, [1] * len(seq_lens), num_kv_heads * group, num_kv_heads, rng.choice([32, 64, 80, 128]),
        block_size, seed=seed,
    )
    caches = [cache.bfloat16() for cache in batch.poisoned_caches()]
    out = batch.attend(cpu_ops.paged_attention, *caches)
    assert_close_over_bf16_cache(out, batch, expected_over_bf16_cache(batch), atol=1e-5)


def test_reshape_and_cache_into_bf16_rounds_as_torch_does() -> None:
    gen = torch.Generator().manual_seed(4)
    shape = (6, 2, 8, 64)
    slots = torch.tensor([3, -1, 47, 8, 20])
    key, value = (torch.randn(len(slots), 2, 64, generator=gen) * 100 for _ in range(2))
    key[0, 0, :4] = torch.tensor([float("inf"), -float("inf"), 3.0e38, 1e-40])  # overflow, subnormal
    expected = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(2)]
    actual = [c.clone() for c in expected]
    reference.reshape_and_cache(key, value, *expected, slots)
    cpu_ops.reshape_and_cache(key, value, *actual, slots)
    for got, want in zip(actual, expected, strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))  # bit for bit


def test_bad_input_is_refused(paged_batch) -> None:
    batch = paged_batch([20, 3], [1, 1], 4, 2, 64, 8)
    op = torch.ops.pagewise_cpu.paged_attention_decode
    with pytest.raises(RuntimeError, match="seq_lens out of the block table"):
        op(batch.query, batch.key_cache, batch.value_cache, batch.block_tables, batch.seq_lens * 100, batch.scale)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        op(batch.query, batch.key_cache.double(), batch.value_cache, batch.block_tables, batch.seq_lens, 1.0)
    with pytest.raises(RuntimeError, match="differ in dtype"):
        op(batch.query, batch.key_cache.bfloat16(), batch.value_cache, batch.block_tables, batch.seq_lens, 1.0)
    slots = torch.tensor([0, batch.key_cache.shape[0] * 8])
    with pytest.raises(RuntimeError, match="slot_mapping out of the cache"):
        cpu_ops.reshape_and_cache(batch.query[:, :2], batch.query[:, :2], batch.key_cache, batch.value_cache, slots)


def test_dispatch_prefers_compiled_for_cpu_float32(monkeypatch) -> None:
    monkeypatch.delenv("PAGEWISE_KERNEL_BACKEND", raising=False)
    assert kernels.backend_for(torch.zeros(1, 1, 1, 1)) == "cpu"
    assert kernels.backend_for(torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)) == "torch"
    bf16_cache = torch.zeros(1, 1, 1, 1, dtype=torch.bfloat16)
    assert kernels.backend_for(torch.zeros(1, 1, 1), bf16_cache) == "cpu"  # fp32 activations over a bf16 cache
    assert kernels.backend_for(torch.zeros(1, 1, 1, dtype=torch.bfloat16), bf16_cache) == "torch"
    assert kernels.backend_for(torch.zeros(1, 1, 1), bf16_cache.half()) == "torch"
    monkeypatch.setenv("PAGEWISE_KERNEL_BACKEND", "torch")
    assert kernels.backend_for(torch.zeros(1, 1, 1, 1)) == "torch"


def test_missing_library_falls_back(monkeypatch, tmp_path) -> None:
    monkeypatch.delenv("PAGEWISE_KERNEL_BACKEND", raising=False)
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(tmp_path))  # nothing built there
    cpu_ops.available.cache_clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert kernels.backend_for(torch.zeros(1, 1, 1, 1)) == "torch"
        assert any("not built" in str(w.message) for w in caught)
    finally:
        cpu_ops.available.cache_clear()


def test_fused_layer_ops_match_reference() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(37, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5))

    gate_up = torch.randn(37, 2 * 1536, generator=gen) * 4
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), reference.silu_and_mul(gate_up))

    residual, delta = torch.randn(37, 576, generator=gen), torch.randn(37, 576, generator=gen)
    expected = residual.clone()
    reference.residual_add(expected, delta)
    cpu_ops.residual_add(residual, delta)
    assert torch.equal(residual, expected)

    # query and key as the QKV split gives them: strided views of one projection output
    heads, kv_heads, dim, max_positions = 9, 3, 64, 300
    qkv = torch.randn(37, (heads + 2 * kv_heads) * dim, generator=gen)
    angles = torch.rand(max_positions, dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    positions = torch.randint(0, max_positions, (37,), generator=gen)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(37, heads, dim), k.view(37, kv_heads, dim), v.view(37, kv_heads, dim)
    expected_q, expected_k = reference.rotary_embedding(positions, q, k, cos, sin)
    v_before = v.clone()
    got_q, got_k = cpu_ops.rotary_embedding(positions, q, k, cos, sin)
    torch.testing.assert_close(got_q, expected_q)
    torch.testing.assert_close(got_k, expected_k)
    assert torch.equal(v, v_before)  # the value slice of the projection is left alone

    with pytest.raises(RuntimeError, match="position out of the rotary tables"):
        cpu_ops.rotary_embedding(positions + max_positions, q, k, cos, sin)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_is_exact_to_float32_rounding_over_its_whole_range(dtype: torch.dtype) -> None:
    """The vectorized SiLU (its own exp, the sigmoid from e^-|g| so nothing overflows) is within a few float32
    ulps of the float64 function from -87 to 100 and at most 1e-34 from it below (where it is all but zero), on
    rows of every length up to 40 (the masked tail of a vector)."""
    gen = torch.Generator().manual_seed(8)
    for size in range(1, 41):
        gate = torch.empty(6, size).uniform_(-100, 100, generator=gen)
        gate[0, : min(size, 8)] = torch.tensor([0.0, -0.0, 87.0, -87.0, -88.0, 1e-30, -1e-30, 100.0])[: min(size, 8)]
        up = torch.randn(6, size, generator=gen) * 4
        gate_up = torch.cat([gate, up], dim=1).to(dtype)
        got = cpu_ops.silu_and_mul(gate_up)
        exact = reference.silu_and_mul(gate_up.double()).float()
        rounded = exact.to(dtype).float()  # a bf16 result is the float32 one rounded once
        tolerance = 4e-7 if dtype == torch.float32 else 2**-8
        torch.testing.assert_close(got.float(), rounded, rtol=tolerance, atol=1e-34)


def test_bf16_outputs_and_inputs_are_the_float32_op_rounded_once() -> None:
    """Under dtype auto the layer ops meet bf16 projections: RMSNorm writes bf16, SiLU-and-multiply reads and
    writes it, the residual add reads a bf16 delta. Each equals the float32 op on the widened input with its
    result rounded to nearest even once (bit for bit where the float32 ops agree bit for bit)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(29, 576, generator=gen) * 3
    weight = torch.randn(576, generator=gen)
    normed = cpu_ops.rms_norm(x, weight, 1e-5, torch.bfloat16)
    assert normed.dtype == torch.bfloat16
    assert torch.equal(normed, cpu_ops.rms_norm(x, weight, 1e-5).bfloat16())
    assert torch.equal(normed, reference.rms_norm(x, weight, 1e-5, torch.bfloat16))

    gate_up = (torch.randn(29, 2 * 1536, generator=gen) * 4).bfloat16()
    got = cpu_ops.silu_and_mul(gate_up)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, reference.silu_and_mul(gate_up), rtol=2**-8, atol=1e-6)  # one bf16 ulp
    assert torch.equal(got, cpu_ops.silu_and_mul(gate_up.float()).bfloat16())

    residual, delta = torch.randn(29, 576, generator=gen), torch.randn(29, 576, generator=gen).bfloat16()
    expected = residual + delta.float()
    cpu_ops.residual_add(residual, delta)
    assert torch.equal(residual, expected)

    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.rms_norm(x, weight, 1e-5, torch.float16)
    with pytest.raises(RuntimeError, match="of the residual's shape"):
        cpu_ops.residual_add(residual, delta[:3])
    assert kernels.backend_for(gate_up, dtypes=(torch.float32, torch.bfloat16)) == "cpu"
    assert kernels.backend_for(gate_up) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_rows_is_torchs_argmax_ties_signs_and_nans_included(dtype: torch.dtype) -> None:
    """The greedy token of every row: torch's argmax (first of ties, a NaN's index where there is one) on random
    rows of the vocabulary sizes the engine meets, rows with planted ties across and inside its scan chunks, signed
    zeros, infinities and NaNs, and strided rows (a slice of a wider tensor)."""
    gen = torch.Generator().manual_seed(11)
    for rows, vocab in ((1, 1), (3, 7), (64, 49152), (5, 32000), (2, 513)):
        x = (torch.randn(rows, vocab, generator=gen) * 8).to(dtype)
        assert torch.equal(cpu_ops.argmax_rows(x), x.float().argmax(-1)), (rows, vocab)
    x = torch.full((8, 2000), -5.0, dtype=dtype)
    x[0, [3, 1500]] = 7.0  # a tie across chunks: the first
    x[1, [600, 601]] = 7.0  # a tie inside a chunk
    x[2] = float("-inf")  # all -inf: index 0
    x[3, 0], x[3, 9] = -0.0, 0.0  # -0 == +0: the first
    x[3, 1:9] = -1.0
    x[3, 10:] = -1.0
    x[4, 1200], x[4, 5] = float("nan"), float("inf")  # a NaN wins, as in torch
    x[5, 77] = float("inf")
    x[6, 1999] = -4.0  # the last element
    x[7] = torch.randn(2000, generator=gen).to(dtype)
    expected = x.float().argmax(-1)
    assert expected.tolist()[:7] == [3, 600, 0, 0, 1200, 77, 1999]
    assert torch.equal(cpu_ops.argmax_rows(x), expected)
    assert torch.equal(reference.argmax_rows(x), expected)
    wide = torch.randn(6, 3000, generator=gen).to(dtype)
    assert torch.equal(kernels.argmax_rows(wide[:, 100:2100]), wide[:, 100:2100].float().argmax(-1))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_ops.argmax_rows(x.half())
    with pytest.raises(RuntimeError, match="non-empty rows"):
        cpu_ops.argmax_rows(torch.zeros(3, 0, dtype=dtype))


def test_forcing_the_compiled_backend_loads_it_or_says_why(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PAGEWISE_KERNEL_BACKEND", "cpu")
    cpu_ops.available.cache_clear()  # as in a fresh process: nothing loaded yet
    assert kernels.backend_for(torch.zeros(1, 1, 1, 1)) == "cpu"
    x = torch.randn(3, 8)
    torch.testing.assert_close(kernels.rms_norm(x, torch.ones(8), 1e-6), reference.rms_norm(x, torch.ones(8), 1e-6))
    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(tmp_path))  # nothing built there
    cpu_ops.available.cache_clear()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with pytest.raises(RuntimeError, match="not built"):
                kernels.backend_for(torch.zeros(1, 1, 1, 1))
    finally:
        cpu_ops.available.cache_clear()


@pytest.mark.parametrize("case", ["decode", "mixed_gqa"])
def test_attention_reads_the_query_where_the_qkv_split_leaves_it(case: str, paged_batch) -> None:
    """The QKV split leaves each token's query heads side by side but the tokens strided: the compiled ops read
    that view in place and give what they give for a contiguous copy, over either cache dtype."""
    batch = paged_batch(*CASES[case], seed=7)
    tokens, heads, head_dim = batch.query.shape
    qkv = torch.randn(tokens, heads * head_dim + 96)
    qkv[:, : heads * head_dim] = batch.query.reshape(tokens, -1)
    split = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not split.is_contiguous()
    for caches in (batch.poisoned_caches(), [cache.bfloat16() for cache in batch.poisoned_caches()]):
        args = (*caches, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
        out = cpu_ops.paged_attention(split, *args)
        assert out.is_contiguous()
        assert torch.equal(out, cpu_ops.paged_attention(batch.query, *args))


@pytest.mark.parametrize("case", ["decode", "mixed_gqa"])
def test_a_bf16_projections_query_key_and_value_give_the_float32_results_rounded_once(case: str, paged_batch) -> None:
    """Under dtype auto Q, K and V come out of the QKV projection in bf16 and stay so: the rotary embedding
    rotates the bf16 views in float32 and rounds once, the cache write copies bf16 rows into a bf16 cache (and
    widens them into a float32 one), and attention takes the bf16 query and gives its result in bf16 — each bit
    for bit the float32 op on the widened input with the result rounded once."""
    batch = paged_batch(*CASES[case], seed=11)
    tokens, heads, head_dim = batch.query.shape
    kv_heads = batch.key_cache.shape[1]
    gen = torch.Generator().manual_seed(12)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).bfloat16()
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    angles = torch.rand(64, head_dim // 2, generator=gen) * 6
    cos, sin = torch.cat([angles.cos()] * 2, dim=-1), torch.cat([angles.sin()] * 2, dim=-1)
    positions = torch.randint(0, 64, (tokens,), generator=gen)
    wide_q, wide_k = cpu_ops.rotary_embedding(positions, q.float(), k.float(), cos, sin)
    expected_q, expected_k = reference.rotary_embedding(positions, q.float(), k.float(), cos, sin)
    v_before = v.clone()
    assert kernels.backend_for(q, dtypes=(torch.float32, torch.bfloat16)) == "cpu"
    got_q, got_k = kernels.rotary_embedding(positions, q, k, cos, sin)
    assert got_q.dtype == got_k.dtype == torch.bfloat16 and got_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(got_q, wide_q.bfloat16()) and torch.equal(got_k, wide_k.bfloat16())
    assert torch.equal(v, v_before)
    for got, expected in ((got_q, expected_q), (got_k, expected_k)):
        torch.testing.assert_close(got.float(), expected, rtol=2**-8, atol=1e-6)  # one bf16 ulp
    with pytest.raises(RuntimeError, match="of one dtype"):
        cpu_ops.rotary_embedding(positions, q, k.float(), cos, sin)

    slots = torch.randperm(batch.key_cache.shape[0] * batch.key_cache.shape[2], generator=gen)[:tokens]
    slots[0] = -1
    for dtype in (torch.bfloat16, torch.float32):
        got = [torch.zeros(batch.key_cache.shape, dtype=dtype) for _ in range(2)]
        want = [cache.clone() for cache in got]
        kernels.reshape_and_cache(k, v, *got, slots)
        reference.reshape_and_cache(k.float(), v.float(), *want, slots)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))

    for caches in (batch.poisoned_caches(), [cache.bfloat16() for cache in batch.poisoned_caches()]):
        args = (*caches, batch.block_tables, batch.seq_lens, batch.query_start_loc, batch.scale)
        out = kernels.paged_attention(q, *args)
        assert out.dtype == torch.bfloat16 and out.is_contiguous()
        assert torch.equal(out, cpu_ops.paged_attention(q.float(), *args).bfloat16())
