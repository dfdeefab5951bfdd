"""The CPU KV cache's memory: one mapping asked for huge pages, carved into per-layer caches."""

from __future__ import annotations

import torch

from pagewise.engine.model_runner import KVCache


def test_cpu_caches_are_zero_separate_and_writable() -> None:
    cache = KVCache(3, 5, 2, 4, 2, 8, torch.bfloat16, torch.device("cpu"))
    tensors = [t for layer in cache.layers for t in layer]
    assert len(tensors) == 6
    assert all(t.shape == (5, 2, 4, 8) and t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)
    assert all(not t.any() for t in tensors)
    for i, t in enumerate(tensors):
        t.fill_(i + 1)  # each its own memory: no write shows through another
    assert [int(t.float().mean()) for t in tensors] == [1, 2, 3, 4, 5, 6]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    assert [h.shape for h in cache.host[0]] == [(2, 2, 4, 8)] * 2  # the swap space is ordinary memory
