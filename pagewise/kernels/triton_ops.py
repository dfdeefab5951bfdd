"""Triton implementations of the paged KV-cache ops, re-exported behind the dispatch in ``pagewise.kernels``.

``swap_blocks`` has no kernel: device <-> host block copies are plain torch copies
(``reference.swap_blocks``).
"""

from __future__ import annotations

from pagewise.kernels.reference import swap_blocks
from pagewise.kernels.triton_attention import paged_attention
from pagewise.kernels.triton_cache_ops import copy_blocks, reshape_and_cache

__all__ = ["copy_blocks", "paged_attention", "reshape_and_cache", "swap_blocks"]
