"""The CPU engine's memory: a KV cache backed when it is made, and glibc told to keep what steps free."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from pagewise.engine.host_memory import backed_zeros, keep_freed_memory


def test_backed_zeros_are_distinct_zero_tensors_whose_pages_are_already_there() -> None:
    shape = (64, 3, 16, 64)
    tensors = backed_zeros(shape, torch.bfloat16, 8)
    assert len(tensors) == 8
    assert all(t.shape == shape and t.dtype == torch.bfloat16 and not t.any() for t in tensors)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for i, tensor in enumerate(tensors):
        tensor.fill_(i)  # every page written: none of them faults in now
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    pages = 8 * tensors[0].numel() * 2 // 4096
    assert faults < pages // 10, f"{faults} page faults writing {pages} pages"
    assert [int(t[-1, -1, -1, -1]) for t in tensors] == list(range(8))  # no two share memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_takes_the_allocator_settings() -> None:
    assert keep_freed_memory()
