"""The engine's compute ops: paged KV-cache ops and a decoder layer's fused ops. One public function per op,
dispatching on the tensor's device and dtype.

CUDA tensors run the Triton kernels; CPU float32 activations (over a float32 or bfloat16 KV cache) run the
compiled CPU kernels (``cpu_ops``, built by ``make install``) where they are built, and the torch reference
otherwise. ``PAGEWISE_KERNEL_BACKEND=triton|cpu|
torch`` (read at every call) forces one backend, which is how the tests run Triton on CPU under
``TRITON_INTERPRET=1`` and compare the compiled kernels with the reference.
"""

from __future__ import annotations

import os

import torch

from pagewise.kernels import cpu_ops, lora, reference

_BACKENDS = ("triton", "cpu", "torch")


def backend_for(
    tensor: torch.Tensor, cache: torch.Tensor | None = None, dtypes: tuple[torch.dtype, ...] = (torch.float32,)
) -> str:
    """The backend an op on activations ``tensor`` (and, for a cache op, ``cache``) runs with: the env override,
    else Triton on CUDA, the compiled kernels where they handle the dtypes (``cpu_ops.supports``; ``dtypes``: the
    activation dtypes the op's compiled form takes), and torch elsewhere."""
    forced = os.environ.get("PAGEWISE_KERNEL_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"PAGEWISE_KERNEL_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        if forced == "cpu" and not cpu_ops.available():
            raise RuntimeError(
                "PAGEWISE_KERNEL_BACKEND=cpu, but the compiled CPU kernels are not built "
                "(python -m pagewise.kernels.cpu_build)"
            )
        return forced
    if tensor.is_cuda:
        return "triton"
    return "cpu" if cpu_ops.supports(tensor, cache, dtypes) else "torch"


def _triton():
    from pagewise.kernels import triton_ops

    return triton_ops


_IMPLS = {"cpu": cpu_ops, "torch": reference}
_BF16_TOO = (torch.float32, torch.bfloat16)  # ops whose compiled form also takes a bf16 projection's output


def _impl(tensor: torch.Tensor, cache: torch.Tensor):
    """The cache ops' backend: their compiled forms take float32 or bf16 activations (a bf16 projection's)."""
    backend = backend_for(tensor, cache, _BF16_TOO)
    return _triton() if backend == "triton" else _IMPLS[backend]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write new keys/values into their cache slots (slot -1 skipped). See ``reference.reshape_and_cache``."""
    _impl(key, key_cache).reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Causal attention over paged K/V for mixed prefill/decode batches. See ``reference.paged_attention``."""
    return _impl(query, key_cache).paged_attention(
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale
    )


def _fused(tensor: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    """The layer ops (no Triton versions): compiled for CPU where built and the dtypes are theirs, else the torch
    reference."""
    return cpu_ops if backend_for(tensor, dtypes=dtypes) == "cpu" else reference


def rms_norm(x, weight, eps, out_dtype=None):
    """RMSNorm over the last dimension of a 2-D ``x``, the result in ``out_dtype`` (default: ``x``'s). See
    ``reference.rms_norm``."""
    return _fused(x).rms_norm(x, weight, eps, out_dtype)


def residual_add(residual, delta) -> None:
    """``residual += delta`` in place (a bf16 delta into a float32 stream widened exactly). See
    ``reference.residual_add``."""
    if delta.dtype == residual.dtype:
        residual.add_(delta)
    else:
        _fused(residual).residual_add(residual, delta)


def argmax_rows(x):
    """The index of each row's largest element of a 2-D ``x`` (the first of ties), int64. See
    ``reference.argmax_rows``; compiled for float32 and bf16 rows."""
    return _fused(x, _BF16_TOO).argmax_rows(x) if x.stride(-1) == 1 else reference.argmax_rows(x)


def rotary_embedding(positions, query, key, cos, sin):
    """Rotary embedding of query and key; returns them rotated. See ``reference.rotary_embedding``."""
    return _fused(query, _BF16_TOO).rotary_embedding(positions, query, key, cos, sin)


def silu_and_mul(gate_up):
    """``silu(gate) * up`` of ``[rows, 2 * size]``, in the input's dtype. See ``reference.silu_and_mul``."""
    return _fused(gate_up, _BF16_TOO).silu_and_mul(gate_up)


def lora_add(y, x, lora_a, lora_b, batch, column_bounds) -> None:
    """Add each row's adapter delta to a projection's output, grouped by adapter slot. See ``lora.lora_add``."""
    backend = backend_for(x, dtypes=_BF16_TOO)
    if backend == "triton":
        from pagewise.kernels import triton_lora

        triton_lora.lora_add(y, x, lora_a, lora_b, batch, column_bounds)
    elif backend == "cpu" and y.dtype in _BF16_TOO and y.stride(1) == 1 and x.stride(1) == 1:
        cpu_ops.lora_add(y, x, lora_a, lora_b, batch, column_bounds)
    else:
        lora.lora_add(y, x, lora_a, lora_b, batch, column_bounds)


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy blocks (src, dst) in every layer at once (copy-on-write). See ``reference.copy_blocks``."""
    impl = _triton() if backend_for(key_caches[0]) == "triton" else reference  # a plain index copy on CPU
    impl.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src, dst, block_mapping) -> None:
    """Copy blocks between device and host caches (plain torch copies on every backend)."""
    reference.swap_blocks(src, dst, block_mapping)


__all__ = [
    "argmax_rows",
    "backend_for",
    "copy_blocks",
    "lora_add",
    "paged_attention",
    "reshape_and_cache",
    "residual_add",
    "rms_norm",
    "rotary_embedding",
    "silu_and_mul",
    "swap_blocks",
]
