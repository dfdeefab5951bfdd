"""Turns a scheduler step into tensors, runs the model over the paged KV cache, and samples."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewise import kernels
from pagewise.engine.adapter_slots import AdapterSlots
from pagewise.engine.host_memory import backed_zeros
from pagewise.engine.kv_cache_manager import BlockOp
from pagewise.engine.models.llama import AttentionMetadata, ForwardPass, LlamaForCausalLM
from pagewise.engine.request import Request
from pagewise.engine.sampler import Sampler, SampleResult
from pagewise.engine.scheduler import SchedulerOutput


class KVCache:
    """Per-layer key/value caches ``[num_blocks, num_kv_heads, block_size, head_dim]`` on the device, plus an
    optional host swap space of the same layout."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        self.num_swap_blocks = num_swap_blocks
        if device.type == "cpu":
            caches = backed_zeros(shape, dtype, 2 * num_layers)
            self.layers = [(caches[2 * i], caches[2 * i + 1]) for i in range(num_layers)]
        else:
            self.layers = [
                (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                for _ in range(num_layers)
            ]
        host_shape = (num_swap_blocks, *shape[1:])
        pin = device.type == "cuda"
        self.host = [
            (
                torch.zeros(host_shape, dtype=dtype, pin_memory=pin),
                torch.zeros(host_shape, dtype=dtype, pin_memory=pin),
            )
            for _ in range(num_layers if num_swap_blocks else 0)
        ]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        return (
            2
            * num_layers
            * block_size
            * num_kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    def run(self, ops: list[BlockOp]) -> None:
        """Execute block copies in order, batching consecutive ops of one kind."""
        start = 0
        while start < len(ops):
            end = start
            while end < len(ops) and ops[end].kind == ops[start].kind:
                end += 1
            self._run_batch(ops[start].kind, [(op.src, op.dst) for op in ops[start:end]])
            start = end

    def _run_batch(self, kind: str, pairs: list[tuple[int, int]]) -> None:
        mapping = torch.tensor(pairs, dtype=torch.int64)
        if kind == "copy":
            kernels.copy_blocks([k for k, _ in self.layers], [v for _, v in self.layers], mapping)
            return
        for (dev_k, dev_v), (host_k, host_v) in zip(self.layers, self.host, strict=True):
            if kind == "swap_out":
                kernels.swap_blocks(dev_k, host_k, mapping)
                kernels.swap_blocks(dev_v, host_v, mapping)
            else:
                kernels.swap_blocks(host_k, dev_k, mapping)
                kernels.swap_blocks(host_v, dev_v, mapping)


@dataclass(slots=True)
class StepRun:
    """A step's forward pass under way (None: the step computes no token, only forks) and the row each sampled
    request reads its logits from."""

    forward: ForwardPass | None
    sample_rows: dict[Request, int]

    @property
    def done(self) -> bool:
        return self.forward is None or self.forward.done

    def run_part(self) -> None:
        assert self.forward is not None
        self.forward.run_part()


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: KVCache,
        sampler: Sampler,
        block_size: int,
        device: torch.device,
        adapters: AdapterSlots | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.adapters = adapters

    def execute(self, step: SchedulerOutput) -> dict[Request, SampleResult | Exception]:
        """Run one step whole; returns a sample for every request whose tokens are all computed after this step
        (or the exception that sampling its row raised)."""
        run = self.start(step)
        while not run.done:
            run.run_part()
        return self.finish(run)

    @torch.inference_mode()
    def start(self, step: SchedulerOutput) -> StepRun:
        """Run the step's block copies and embed its tokens: the rest runs a part at a time (``StepRun``)."""
        self.kv_cache.run(step.block_ops)
        batch = [(r, n) for r, n in step.scheduled.items() if n > 0]
        if not batch:
            return StepRun(None, {})
        input_ids, positions, slots, seq_lens, starts, row_slots = [], [], [], [], [0], []
        sample_rows: dict[Request, int] = {}
        bs = self.block_size
        adapters = self.adapters
        for request, num_new in batch:
            if adapters is not None:
                row_slots += [-1 if request.adapter is None else adapters.slot_of(request.adapter)] * num_new
            begin = request.num_computed_tokens
            end = begin + num_new
            input_ids.extend(request.token_ids[begin:end])
            positions.extend(range(begin, end))
            table = request.block_ids
            slots.extend(table[p // bs] * bs + p % bs for p in range(begin, end))
            seq_lens.append(end)
            starts.append(starts[-1] + num_new)
            if end == request.num_tokens:
                sample_rows[request] = starts[-1] - 1
        for follower, leader in step.sample_sources.items():
            if leader in sample_rows:
                sample_rows[follower] = sample_rows[leader]
        max_blocks = max(len(r.block_ids) for r, _ in batch)
        tables = [r.block_ids + [0] * (max_blocks - len(r.block_ids)) for r, _ in batch]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        )
        forward = self.model.start(
            torch.tensor(input_ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            self.kv_cache.layers,
            meta,
            None if adapters is None else adapters.batch(row_slots),
        )
        return StepRun(forward, sample_rows)

    @torch.inference_mode()
    def finish(self, run: StepRun) -> dict[Request, SampleResult | Exception]:
        """Logits for the sampled rows and their samples (every layer of ``run`` must have run)."""
        if run.forward is None or not run.sample_rows:
            return {}
        hidden = run.forward.output()
        requests = list(run.sample_rows)
        rows = torch.tensor([run.sample_rows[r] for r in requests], dtype=torch.int64, device=self.device)
        dtype = None if Sampler.argmax_only(requests) else torch.float32
        logits = self.model.compute_logits(hidden.index_select(0, rows), dtype)
        return dict(zip(requests, self.sampler(logits, requests), strict=True))


@torch.inference_mode()
def profile_forward(
    model: LlamaForCausalLM, num_tokens: int, max_seq_len: int, num_sample_rows: int, block_size: int
) -> None:
    """Run the largest step there can be — ``num_tokens`` prompt tokens in sequences of at most ``max_seq_len``,
    then logits and log-probabilities for ``num_sample_rows`` rows — over dummy input, so that its activation
    memory can be measured. Uses a one-block KV cache of its own and writes no cache slot."""
    arch = model.arch
    weight = next(model.parameters())
    dev = weight.device
    cache = KVCache(arch.num_layers, 1, 0, block_size, arch.num_kv_heads, arch.head_dim, weight.dtype, dev)
    num_full, rest = divmod(num_tokens, max_seq_len)
    lens = [max_seq_len] * num_full + ([rest] if rest else [])
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=dev),
        block_tables=torch.zeros((len(lens), -(-max(lens) // block_size)), dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
    )
    positions = torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in lens])
    hidden = model(torch.zeros(num_tokens, dtype=torch.int64, device=dev), positions, cache.layers, meta)
    logits = model.compute_logits(hidden[-min(num_sample_rows, num_tokens) :])
    torch.log_softmax(logits, dim=-1)
