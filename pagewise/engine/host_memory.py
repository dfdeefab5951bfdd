"""How a CPU engine holds its memory: a KV cache backed before the first step, and freed activations kept.

Both remove page faults from the steps. A page the process touches for the first time costs a fault and the
kernel's zeroing of it; the offline mixed run of 64 requests took some 480,000 of them in its steps (about 48,000
after), from two sources:

- the KV cache, a mapping of several GiB whose blocks are first written one step at a time;
- the activations, freed and allocated again every step: glibc serves allocations above its mmap threshold with
  fresh mappings and returns freed heap tops to the kernel, so the next step faults them in again.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import math
import mmap

import torch

# madvise(2) advice, Linux 5.14+: fault every page of the range in now, writable (not every Python exposes it).
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)

# mallopt(3) parameters and the values set: every allocation up to 32 MiB (glibc's largest mmap threshold on
# 64-bit) comes from the heap, and up to 256 MiB freed at a heap's top stays with the process.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MALLOC_SETTINGS = ((_M_MMAP_THRESHOLD, 32 << 20), (_M_TRIM_THRESHOLD, 256 << 20), (_M_TOP_PAD, 64 << 20))


def backed_zeros(shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
    """``count`` zero CPU tensors of ``shape``, carved from one anonymous mapping whose pages are all backed when
    this returns, with 2 MiB pages where the kernel grants them (``MADV_HUGEPAGE`` first: transparent huge pages
    are often enabled only on request; the attention kernels read a sequence's blocks scattered over the whole
    cache, and with 4 KiB pages nearly every block costs a TLB miss). Backing it at once (``MADV_POPULATE_WRITE``)
    takes 0.6 s for 2 GiB where the steps' first writes took several times that; a kernel without that advice
    backs the pages as they are first written."""
    numel = math.prod(shape)
    size = count * numel * torch.empty((), dtype=dtype).element_size()
    region = mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # shared: no huge pages
    if hasattr(mmap, "MADV_HUGEPAGE"):
        region.madvise(mmap.MADV_HUGEPAGE)
    with contextlib.suppress(OSError):  # EINVAL before Linux 5.14
        region.madvise(_MADV_POPULATE_WRITE)
    flat = torch.frombuffer(region, dtype=dtype, count=count * numel)
    return [flat[i * numel : (i + 1) * numel].view(shape) for i in range(count)]


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's allocator to keep what a step frees for the next step (``_MALLOC_SETTINGS``); once per process.
    False where the C library is not glibc (no ``mallopt``) or refuses a setting: allocation then stays as it was.
    The cost is memory the process holds after a peak: at most the trim threshold per allocator arena."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    libc = ctypes.CDLL(name)
    mallopt = getattr(libc, "mallopt", None)
    if mallopt is None:
        return False
    return all(mallopt(param, value) == 1 for param, value in _MALLOC_SETTINGS)
