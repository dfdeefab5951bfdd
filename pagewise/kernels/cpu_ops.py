"""The compiled CPU kernels (``cpu_build``), loaded once, with the torch reference for what they do not cover.

The ops keep ``reference``'s contracts (``rotary_embedding`` rotates its inputs in place and returns them).

``available()`` loads the library built by ``python -m pagewise.kernels.cpu_build``; if it is missing or fails to
load, it warns once and answers False, and the CPU path runs the torch reference instead. The compiled ops take
float32 activations (and bf16 where an op says so: the norm's output, SiLU-and-multiply, the residual add's delta,
the rotary embedding, the cache write, attention's query and result) and float32 or bfloat16 caches;
``paged_attention`` runs decode rows (one query token) through the compiled op, and prefill chunks through the
compiled mixed op over a bf16 cache where it runs (``bf16_prefill_compiled``), else through the reference's
per-sequence attention, so every path computes the same function as ``reference.paged_attention`` (to float32
rounding, or to bf16 over a bf16 cache: the compiled ops sum in a different order and round the scaled query to
bf16).
"""

from __future__ import annotations

import functools
import warnings

import torch

from pagewise.kernels import reference


@functools.cache
def available() -> bool:
    from pagewise.kernels import cpu_build

    path = cpu_build.library_path()
    if not path.exists():
        warnings.warn(
            "pagewise: compiled CPU kernels are not built (run `make install` or "
            "`python -m pagewise.kernels.cpu_build`); using the slower torch reference",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as error:
        warnings.warn(
            f"pagewise: compiled CPU kernels failed to load ({error}); using the torch reference",
            RuntimeWarning,
            stacklevel=2,
        )
        return False
    return True


CACHE_DTYPES = (torch.float32, torch.bfloat16)


def supports(
    tensor: torch.Tensor, cache: torch.Tensor | None = None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> bool:
    """Whether the compiled ops handle activations like ``tensor`` (on CPU, of one of ``dtypes``: float32 unless
    the op takes a bf16 projection's output too) and, for a cache op, a cache like ``cache`` (CPU float32 or
    bfloat16), the library being loaded."""
    if tensor.device.type != "cpu" or tensor.dtype not in dtypes:
        return False
    if cache is not None and (cache.device.type != "cpu" or cache.dtype not in CACHE_DTYPES):
        return False
    return available()


def rms_norm(x, weight, eps, out_dtype=None):
    return torch.ops.pagewise_cpu.rms_norm(x, weight, eps, out_dtype)


def residual_add(residual, delta) -> None:
    torch.ops.pagewise_cpu.residual_add(residual, delta)


def argmax_rows(x):
    return torch.ops.pagewise_cpu.argmax_rows(x)


def rotary_embedding(positions, query, key, cos, sin):
    """In place on the query and key views (their heads' rows contiguous, as the QKV split gives)."""
    torch.ops.pagewise_cpu.rotary_embedding(positions, query, key, cos, sin)
    return query, key


def silu_and_mul(gate_up):
    return torch.ops.pagewise_cpu.silu_and_mul(gate_up)


def lora_add(y, x, lora_a, lora_b, batch, column_bounds) -> None:
    """``lora.lora_add``'s contract in one compiled call (float32 or bf16 stacks; x and y float32 or bf16)."""
    torch.ops.pagewise_cpu.lora_add(
        y, x, lora_a, lora_b, batch.order, batch.segment_starts, batch.segment_slots, batch.segment_scalings,
        column_bounds,
    )  # fmt: skip


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    torch.ops.pagewise_cpu.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """``reference.paged_attention``'s contract: decode rows compiled, and prefill chunks too over a bf16 cache
    where ``mixed_attention_runs``."""
    starts = query_start_loc.tolist()
    num_seqs = len(starts) - 1
    if starts[-1] == num_seqs:  # every sequence decodes one token: the common step, no regrouping
        return torch.ops.pagewise_cpu.paged_attention_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale
        )
    if mixed_attention_runs(query, key_cache):
        return torch.ops.pagewise_cpu.paged_attention_mixed(
            query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
        )
    return reference.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        decode=torch.ops.pagewise_cpu.paged_attention_decode,
    )


def mixed_attention_runs(query: torch.Tensor, key_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention_mixed`` takes this step: a float32 or bf16 query over a bf16 cache, head_dim a
    multiple of 32 up to 256, at most 8 query heads per kv head, on a CPU where the compiled prefill runs
    (``bf16_prefill_compiled``)."""
    head_dim, group = query.shape[-1], query.shape[-2] // key_cache.shape[1]
    return (
        key_cache.dtype == torch.bfloat16
        and query.dtype in (torch.float32, torch.bfloat16)
        and head_dim % 32 == 0
        and head_dim <= 256
        and group <= 8
        and bf16_prefill_compiled()
    )


@functools.cache
def bf16_prefill_compiled() -> bool:
    """Prefill chunks over a bf16 cache run compiled on a CPU with AVX512-BF16 and no AMX, the library loaded.

    Without AMX, torch's flash attention multiplies its small bf16 blocks at a fraction of the CPU's rate (on Zen 4
    the reference runs at 13-28 GFLOP/s on 8 prompts of 128-512 tokens, the compiled op at 31-53:
    ``docs/benchmarks.md``). With AMX it multiplies on AMX tiles, which the compiled op (written for
    ``vdpbf16ps``) does not use, and it stays.
    """
    from pagewise.kernels.gemm import cpu_flags  # gemm imports this module

    flags = cpu_flags()
    return "avx512_bf16" in flags and "amx_bf16" not in flags and available()


def linear_few_rows(x, weight, bias, out_dtype):
    """``x Wᵀ + b`` for a few rows of ``x`` and a contiguous float32 or bf16 ``weight``: the weight streamed once,
    sums of exact products in float32, the result in ``out_dtype`` (float32 or bf16). Needs AVX2 and FMA for a
    float32 weight, AVX512-BF16 for a bf16 one (``gemm.few_rows_product_available``)."""
    return torch.ops.pagewise_cpu.linear_few_rows(x, weight, bias, out_dtype)
