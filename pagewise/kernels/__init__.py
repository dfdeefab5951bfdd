"""Paged KV-cache ops. One public function per op, dispatching on the tensor's device.

CUDA tensors run the Triton kernels; CPU tensors run the torch reference. ``PAGEWISE_KERNEL_BACKEND=triton|torch``
(read at every call) forces one backend, which is how the tests run Triton on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import os

import torch

from pagewise.kernels import reference

_BACKENDS = ("triton", "torch")


def backend_for(tensor: torch.Tensor) -> str:
    """The backend an op on ``tensor`` runs with: the env override, else Triton on CUDA and torch elsewhere."""
    forced = os.environ.get("PAGEWISE_KERNEL_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"PAGEWISE_KERNEL_BACKEND must be one of {_BACKENDS}, got {forced!r}")
        return forced
    return "triton" if tensor.is_cuda else "torch"


def _triton():
    from pagewise.kernels import triton_ops

    return triton_ops


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping) -> None:
    """Write new keys/values into their cache slots (slot -1 skipped). See ``reference.reshape_and_cache``."""
    impl = _triton() if backend_for(key) == "triton" else reference
    impl.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale):
    """Causal attention over paged K/V for mixed prefill/decode batches. See ``reference.paged_attention``."""
    impl = _triton() if backend_for(query) == "triton" else reference
    return impl.paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale)


def copy_blocks(key_caches, value_caches, block_mapping) -> None:
    """Copy blocks (src, dst) in every layer at once (copy-on-write). See ``reference.copy_blocks``."""
    impl = _triton() if backend_for(key_caches[0]) == "triton" else reference
    impl.copy_blocks(key_caches, value_caches, block_mapping)


def swap_blocks(src, dst, block_mapping) -> None:
    """Copy blocks between device and host caches (plain torch copies on every backend)."""
    reference.swap_blocks(src, dst, block_mapping)


__all__ = ["backend_for", "copy_blocks", "paged_attention", "reshape_and_cache", "swap_blocks"]
