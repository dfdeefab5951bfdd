"""Kernel-test fixtures: random paged batches, and a switch that puts the Triton kernels in interpreter mode.

``triton.jit`` picks compiled vs interpreted when a function is *decorated*, reading ``TRITON_INTERPRET`` then
-- and that includes triton's own library functions (``tl.zeros``, ``tl.sum``, ...), decorated when triton is
first imported. So a process can interpret Triton only if ``TRITON_INTERPRET=1`` was set before triton was
imported, and once it has, compiled kernels no longer work in it.

``triton_interpreter`` therefore runs the interpreter tests in this process only when that is safe and
possible: triton not imported yet (or imported in interpreter mode) and no CUDA device (a GPU process must
keep compiled Triton for the tests that follow). Otherwise those tests skip here and
``test_triton_kernels.py::test_interpreter_checks_in_subprocess`` reruns the file in a fresh interpreter-mode
subprocess. Either way the fixture asserts that the kernels really are interpreted.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import pytest
import torch

TRITON_MODULES = (
    "pagewise.kernels.triton_attention",
    "pagewise.kernels.triton_cache_ops",
    "pagewise.kernels.triton_lora",
    "pagewise.kernels.triton_ops",  # last: re-exports the two above
)
INNER_RUN_ENV = "PAGEWISE_TRITON_INTERPRETER_SUBPROCESS"


def _is_interpreted(fn: object) -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(fn, InterpretedFunction)


def _kernels_interpreted() -> bool:
    attention = sys.modules["pagewise.kernels.triton_attention"]
    cache_ops = sys.modules["pagewise.kernels.triton_cache_ops"]
    lora = sys.modules["pagewise.kernels.triton_lora"]
    kernels = (
        attention._find_seq,
        attention._paged_attention_kernel,
        attention._reduce_splits_kernel,
        cache_ops._reshape_and_cache_kernel,
        cache_ops._copy_blocks_kernel,
        lora._segment_rows,
        lora._shrink_kernel,
        lora._expand_kernel,
    )
    return all(_is_interpreted(k) for k in kernels)


def interpreter_in_process_ok() -> bool:
    """Whether this process can (and may) run the Triton interpreter tests itself."""
    if os.environ.get(INNER_RUN_ENV) == "1":
        return True
    if "triton" in sys.modules:
        import triton.language as tl

        return _is_interpreted(tl.zeros)
    return not torch.cuda.is_available()


@pytest.fixture
def interpreter_in_process() -> bool:
    """``interpreter_in_process_ok()`` as a fixture."""
    return interpreter_in_process_ok()


@pytest.fixture(scope="module")
def triton_interpreter() -> Iterator[None]:
    """Every pagewise Triton kernel (and triton's library) in interpreter mode, or skip (see module doc)."""
    if not interpreter_in_process_ok():
        pytest.skip(
            "triton is compiled-mode in this process; covered by test_interpreter_checks_in_subprocess"
        )
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import
    try:
        tl = pytest.importorskip("triton.language")
        assert _is_interpreted(tl.zeros), "triton did not honour TRITON_INTERPRET=1"
        for name in TRITON_MODULES:
            if name in sys.modules:
                importlib.reload(sys.modules[name])
            else:
                importlib.import_module(name)
        assert _kernels_interpreted(), "pagewise kernels are not interpreted"
        yield
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = previous


@dataclass
class PagedBatch:
    """Random sequences laid out in a paged cache, plus the same K/V contiguous per sequence.

    ``used[b, o]`` marks the cache slots holding some sequence's context; every other slot (the tail of a
    last block, spare blocks) is zero in ``key_cache``/``value_cache`` and NaN in ``poisoned_caches()``.
    """

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    used: torch.Tensor
    scale: float

    def poisoned_caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        unused = ~self.used[:, None, :, None]
        return (
            self.key_cache.masked_fill(unused, float("nan")),
            self.value_cache.masked_fill(unused, float("nan")),
        )

    def attend(self, paged_attention, key_cache=None, value_cache=None) -> torch.Tensor:  # noqa: ANN001
        """``paged_attention`` (any implementation of the op) over this batch, on its caches or the ones given."""
        return paged_attention(
            self.query,
            self.key_cache if key_cache is None else key_cache,
            self.value_cache if value_cache is None else value_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
        )

    def queries_of(self, seq: int) -> torch.Tensor:
        start, end = self.query_start_loc[seq : seq + 2].tolist()
        return self.query[start:end]


def make_paged_batch(
    seq_lens: Sequence[int],
    q_lens: Sequence[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    """Sequence ``s`` has ``seq_lens[s]`` tokens of context, the last ``q_lens[s]`` of them new (queried).

    Blocks are drawn in random order from a pool with spare blocks; each block-table row is padded with random
    block ids past the blocks it needs (as an engine's padded table would be).
    """
    assert len(seq_lens) == len(q_lens) and all(0 < q <= n for q, n in zip(q_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    max_blocks = max(needed) + 1
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(0, num_blocks, (len(seq_lens), max_blocks), generator=gen, dtype=torch.int32)
    key_cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    keys, values = [], []
    next_block = 0
    for s, n in enumerate(seq_lens):
        blocks = perm[next_block : next_block + needed[s]]
        next_block += needed[s]
        table[s, : needed[s]] = blocks.int()
        k = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype)
        pos = torch.arange(n)
        b, o = blocks[pos // block_size], pos % block_size
        key_cache[b, :, o] = k
        value_cache[b, :, o] = v
        used[b, o] = True
        keys.append(k)
        values.append(v)
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen).to(dtype)
    return PagedBatch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        keys=keys,
        values=values,
        used=used,
        scale=head_dim**-0.5,
    )


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    """The ``make_paged_batch`` builder."""
    return make_paged_batch
