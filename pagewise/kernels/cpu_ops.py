"""The compiled CPU kernels (``cpu_build``), loaded once, with the torch reference for what they do not cover.

The ops keep ``reference``'s contracts (``rotary_embedding`` rotates its inputs in place and returns them).

``available()`` loads the library built by ``python -m pagewise.kernels.cpu_build``; if it is missing or fails to
load, it warns once and answers False, and the CPU path runs the torch reference instead. The compiled ops take
float32 activations (and bf16 where an op says so) and float32 or bfloat16 caches; ``paged_attention`` runs decode
rows (one query token) through the compiled op and prefill chunks through the reference's per-sequence attention,
so both paths compute the same function as ``reference.paged_attention`` (to float32 rounding: the compiled op sums
in a different order).
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
    """``reference.paged_attention``'s contract, decode rows compiled."""
    starts = query_start_loc.tolist()
    num_seqs = len(starts) - 1
    if starts[-1] == num_seqs:  # every sequence decodes one token: the common step, no regrouping
        return torch.ops.pagewise_cpu.paged_attention_decode(
            query, key_cache, value_cache, block_tables, seq_lens, scale
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


def linear_few_rows(x, weight, bias, out_dtype):
    """``x Wᵀ + b`` for a few rows of ``x`` and a contiguous float32 or bf16 ``weight``: the weight streamed once,
    sums of exact products in float32, the result in ``out_dtype`` (float32 or bf16). Needs AVX2 and FMA for a
    float32 weight, AVX512-BF16 for a bf16 one (``gemm.few_rows_product_available``)."""
    return torch.ops.pagewise_cpu.linear_few_rows(x, weight, bias, out_dtype)
