"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

Numerics follow HF transformers' Llama: RMSNorm in fp32, RoPE with ``rotate_half`` on HF-layout weights,
SiLU-gated MLP. Q/K/V and gate/up projections are fused into single matmuls.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from pagewise import kernels
from pagewise.engine.model_config import ModelArchConfig
from pagewise.kernels.gemm import GemmPath, GemmPlan, PackedWeight
from pagewise.kernels.lora import LoraBatch

if TYPE_CHECKING:
    from pagewise.engine.adapter_files import AdapterWeights

# a layer's MLP runs in parts of at most this many rows (tokens), each a pause point of a preemptible step: a
# 2,048-token step pauses about every quarter of a layer, a step of 512 tokens or fewer once per half layer
MLP_ROWS_PER_PART = 512


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens go in the paged cache and which context each sequence's queries see."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32


class Linear(nn.Linear):
    """``nn.Linear`` whose product runs on a chosen matmul path (``pagewise.kernels.gemm``), in a chosen dtype:
    ``torch`` in the weight's dtype until ``use_gemm_plan``, which prepares the weight as it is then — so it is
    called once the weights are loaded and on their device, and the weight is not changed afterwards. A
    projection adapters may target carries their slot stacks (``lora_a``, ``lora_b``: see ``LoraProjection``)."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self._gemm: PackedWeight | None = None
        self.lora_a: torch.Tensor | None = None
        self.lora_b: torch.Tensor | None = None
        self.lora_column_bounds: torch.Tensor | None = None

    def use_gemm_plan(self, plan: GemmPlan, compute_dtype: torch.dtype | None = None) -> None:
        """Run each product as ``plan`` says for its row count, with weight and inputs in ``compute_dtype``
        (default: the weight's; see ``PackedWeight``)."""
        bias = None if self.bias is None else self.bias.detach()
        plain = plan == GemmPlan.single(GemmPath.TORCH) and compute_dtype in (None, self.weight.dtype)
        self._gemm = None if plain else PackedWeight(plan, self.weight.detach(), bias, compute_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the product: an input in it is taken as it is, and an output in it is not converted."""
        return self.weight.dtype if self._gemm is None else self._gemm.compute_dtype

    def forward(
        self, x: torch.Tensor, out_dtype: torch.dtype | None = None, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """``x Wᵀ + b`` in ``out_dtype`` (default: ``x``'s), plus each ``lora`` row's adapter delta."""
        if self._gemm is not None:
            y = self._gemm(x, out_dtype)
        else:
            y = F.linear(x, self.weight, self.bias)
            y = y if out_dtype in (None, y.dtype) else y.to(out_dtype)
        if lora is not None and self.lora_a is not None:
            kernels.lora_add(y, x, self.lora_a, self.lora_b, lora, self.lora_column_bounds)
        return y


@dataclass(slots=True)
class LoraProjection:
    """A projection adapters may target: its layer, its ``Linear`` and the HF projections fused in it (name and
    output size, in output order). Each part gets ``max_rank`` rows of ``lora_a`` and of ``lora_b``, whose
    columns it owns alone (block-diagonal; ``kernels.lora``), so one product per adapter covers the fused
    projection."""

    layer: int
    linear: Linear
    parts: tuple[tuple[str, int], ...]

    def allocate(self, num_slots: int, max_rank: int) -> None:
        """Zeroed slot stacks on the projection's device, in its compute dtype (float32 stacks are exact; a bf16
        projection gets bf16 stacks, half the weight traffic of a step), and the columns each part owns."""
        linear, rank, device = self.linear, len(self.parts) * max_rank, self.linear.weight.device
        dtype = linear.compute_dtype
        linear.lora_a = torch.zeros(num_slots, rank, linear.in_features, device=device, dtype=dtype)
        linear.lora_b = torch.zeros(num_slots, rank, linear.out_features, device=device, dtype=dtype)
        bounds = [0]
        for _, size in self.parts:
            bounds.append(bounds[-1] + size)
        linear.lora_column_bounds = torch.tensor(bounds, dtype=torch.int64, device=device)

    def write(self, slot: int, adapter: AdapterWeights) -> None:
        """Put ``adapter``'s weights for this projection in ``slot`` (zeros where it targets no part; a lower
        rank is zero-padded)."""
        lora_a, lora_b = self.linear.lora_a[slot], self.linear.lora_b[slot]
        lora_a.zero_()
        lora_b.zero_()
        max_rank, out_start = lora_a.shape[0] // len(self.parts), 0
        for index, (name, size) in enumerate(self.parts):
            pair = adapter.weights.get((self.layer, name))
            if pair is not None:
                rank, first = pair[0].shape[0], index * max_rank
                lora_a[first : first + rank] = torch.from_numpy(pair[0])
                lora_b[first : first + rank, out_start : out_start + size] = torch.from_numpy(pair[1]).t()
            out_start += size


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps, out_dtype)


def _inverse_frequencies(arch: ModelArchConfig) -> torch.Tensor:
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind not in (None, "default"):
        raise ValueError(f"unsupported rope_scaling type {kind!r}")
    return inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to ``max_positions``, computed once in fp32."""

    def __init__(self, arch: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = _inverse_frequencies(arch)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rotated q and k (possibly the same tensors, rotated in place)."""
        return kernels.rotary_embedding(positions, q, k, self.cos, self.sin)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, arch.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(arch.hidden_size, self.q_size + 2 * self.kv_size, bias=arch.attention_bias)
        self.o_proj = Linear(self.q_size, arch.hidden_size, bias=False)
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        hidden: torch.Tensor,
        rotary: RotaryEmbedding,
        positions: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Attention of ``hidden`` (the normed residual rows, in the model's or the projections' dtype); the
        result in the projections' dtype, to be added to the residual stream.

        Q, K and V stay in the projections' dtype where the cache holds that dtype (bf16 projections over a bf16
        cache: the cache rounds K and V to it anyway and attention rounds its scaled query to it), else they come
        out in the model's. Rotary, the cache write and attention compute in fp32 either way."""
        num_tokens = hidden.shape[0]
        key_cache, value_cache = kv_cache
        projected = self.qkv_proj.compute_dtype
        qkv_dtype = projected if projected == key_cache.dtype else self.o_proj.weight.dtype
        q, k, v = self.qkv_proj(hidden, qkv_dtype, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        kernels.reshape_and_cache(k, v, key_cache, value_cache, meta.slot_mapping)
        out = kernels.paged_attention(
            q, key_cache, value_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, self.scale
        )
        return self.o_proj(out.reshape(num_tokens, self.q_size), self.o_proj.compute_dtype, lora)


class MLP(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(arch.hidden_size, 2 * arch.intermediate_size, bias=False)
        self.down_proj = Linear(arch.intermediate_size, arch.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """The MLP of ``x`` (normed rows), kept in the projections' dtype from end to end."""
        gate_up = self.gate_up_proj(x, self.gate_up_proj.compute_dtype, lora)
        return self.down_proj(kernels.silu_and_mul(gate_up), self.down_proj.compute_dtype, lora)


class DecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.mlp = MLP(arch)

    def forward(self, hidden, rotary, positions, kv_cache, meta, lora=None) -> torch.Tensor:
        return self.feed_forward(self.attend(hidden, rotary, positions, kv_cache, meta, lora), lora)

    def attend(self, hidden, rotary, positions, kv_cache, meta, lora=None) -> torch.Tensor:
        """The attention half: ``hidden`` plus attention over the paged cache (in place). The residual stream
        stays in the model's dtype; the normed rows go to the projections in theirs."""
        normed = self.input_layernorm(hidden, self.self_attn.qkv_proj.compute_dtype)
        kernels.residual_add(hidden, self.self_attn(normed, rotary, positions, kv_cache, meta, lora))
        return hidden

    def feed_forward(self, rows: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        """The MLP half, row by row independent: ``rows`` plus the MLP of their norm (in place); ``lora``
        describes these rows (numbered from 0)."""
        normed = self.post_attention_layernorm(rows, self.mlp.gate_up_proj.compute_dtype)
        kernels.residual_add(rows, self.mlp(normed, lora))
        return rows


class LlamaForCausalLM(nn.Module):
    """``forward(input_ids, positions, kv_caches, meta)`` returns hidden states; ``compute_logits`` the
    logits of the selected rows only (the LM head is the largest matmul: run it only where we sample)."""

    def __init__(self, arch: ModelArchConfig, max_positions: int) -> None:
        super().__init__()
        self.arch = arch
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(arch) for _ in range(arch.num_layers))
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps)
        self.lm_head = Linear(arch.hidden_size, arch.vocab_size, bias=False)
        if arch.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(arch, max_positions)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        run = self.start(input_ids, positions, kv_caches, meta, lora)
        while not run.done:
            run.run_part()
        return run.output()

    def start(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> ForwardPass:
        """The forward pass over these tokens, embedded and ready to run a part at a time; ``lora`` says which
        rows run under which adapter slot (None: all under the base model)."""
        return ForwardPass(self, positions, kv_caches, meta, self.embed_tokens(input_ids), lora)

    def lora_projections(self) -> list[LoraProjection]:
        """Every projection adapters may target, layer by layer."""
        attn_parts = (("q_proj", self.layers[0].self_attn.q_size),) + tuple(
            (name, self.layers[0].self_attn.kv_size) for name in ("k_proj", "v_proj")
        )
        mlp_parts = tuple((name, self.arch.intermediate_size) for name in ("gate_proj", "up_proj"))
        projections = []
        for i, layer in enumerate(self.layers):
            projections += [
                LoraProjection(i, layer.self_attn.qkv_proj, attn_parts),
                LoraProjection(i, layer.self_attn.o_proj, (("o_proj", self.arch.hidden_size),)),
                LoraProjection(i, layer.mlp.gate_up_proj, mlp_parts),
                LoraProjection(i, layer.mlp.down_proj, (("down_proj", self.arch.hidden_size),)),
            ]
        return projections

    def use_gemm_plan(self, plan: GemmPlan, compute_dtype: torch.dtype | None = None) -> None:
        """Run every projection, the LM head included, as ``plan`` says in ``compute_dtype`` (see
        ``Linear.use_gemm_plan``)."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.use_gemm_plan(plan, compute_dtype)

    def compute_logits(self, hidden: torch.Tensor, dtype: torch.dtype | None = torch.float32) -> torch.Tensor:
        """The logits of ``hidden``'s rows in ``dtype``; None: the LM head's own (a bf16 head's output as it is,
        for a caller that only takes each row's argmax, which the exact widening to fp32 would not change)."""
        return self.lm_head(hidden, dtype or self.lm_head.compute_dtype)

    def load_hf_weights(self, weights: dict[str, torch.Tensor]) -> None:
        """Load HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` …), fusing qkv and gate/up."""
        own = self.state_dict()
        loaded: set[str] = set()

        def put(name: str, tensor: torch.Tensor) -> None:
            if own[name].shape != tensor.shape:
                raise ValueError(
                    f"weight {name}: expected shape {tuple(own[name].shape)}, got {tuple(tensor.shape)}"
                )
            own[name].copy_(tensor)
            loaded.add(name)

        put("embed_tokens.weight", weights["model.embed_tokens.weight"])
        put("norm.weight", weights["model.norm.weight"])
        if not self.arch.tie_word_embeddings:
            put("lm_head.weight", weights["lm_head.weight"])
        for i in range(self.arch.num_layers):
            src, dst = f"model.layers.{i}.", f"layers.{i}."
            attn = src + "self_attn."
            put(
                dst + "self_attn.qkv_proj.weight",
                torch.cat([weights[attn + f"{p}_proj.weight"] for p in "qkv"]),
            )
            if self.arch.attention_bias:
                put(
                    dst + "self_attn.qkv_proj.bias",
                    torch.cat([weights[attn + f"{p}_proj.bias"] for p in "qkv"]),
                )
            put(dst + "self_attn.o_proj.weight", weights[attn + "o_proj.weight"])
            mlp = src + "mlp."
            put(
                dst + "mlp.gate_up_proj.weight",
                torch.cat([weights[mlp + "gate_proj.weight"], weights[mlp + "up_proj.weight"]]),
            )
            put(dst + "mlp.down_proj.weight", weights[mlp + "down_proj.weight"])
            put(dst + "input_layernorm.weight", weights[src + "input_layernorm.weight"])
            put(dst + "post_attention_layernorm.weight", weights[src + "post_attention_layernorm.weight"])
        missing = {
            n
            for n in own
            if n not in loaded and not (n == "lm_head.weight" and self.arch.tie_word_embeddings)
        }
        if missing:
            raise ValueError(f"weights missing for: {sorted(missing)[:5]}")


@dataclass(slots=True)
class ForwardPass:
    """One forward pass, run a part at a time so that it can be set aside between two parts and resumed later. A
    layer's parts are its attention half, then its MLP half over at most ``MLP_ROWS_PER_PART`` rows at a time (the
    MLP is row by row independent, so a long step's layer offers several pause points).

    Invariants: everything the pass carries from one part to the next is ``hidden`` (the residual stream),
    ``next_layer`` and ``mlp_rows_done`` (None until the layer's attention half has run); layer ``i`` reads and
    writes only the KV slots of ``meta`` in layer ``i``'s cache, so work run while the pass is set aside changes
    nothing it computes as long as it touches none of those slots. Running every part gives exactly
    ``LlamaForCausalLM.forward``'s result (which is this loop), whether or not it was set aside.
    """

    model: LlamaForCausalLM
    positions: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    meta: AttentionMetadata
    hidden: torch.Tensor
    lora: LoraBatch | None = None
    next_layer: int = 0
    mlp_rows_done: int | None = None

    @property
    def done(self) -> bool:
        return self.next_layer == len(self.model.layers)

    @torch.inference_mode()
    def run_part(self) -> None:
        layer = self.model.layers[self.next_layer]
        if self.mlp_rows_done is None:
            kv_cache = self.kv_caches[self.next_layer]
            rotary = self.model.rotary
            self.hidden = layer.attend(self.hidden, rotary, self.positions, kv_cache, self.meta, self.lora)
            self.mlp_rows_done = 0
            return
        start, num_rows = self.mlp_rows_done, self.hidden.shape[0]
        end = min(start + MLP_ROWS_PER_PART, num_rows)
        lora = self.lora
        if lora is not None and (start, end) != (0, num_rows):
            lora = lora.restrict(start, end)
        layer.feed_forward(self.hidden[start:end], lora)
        self.mlp_rows_done = end
        if end == self.hidden.shape[0]:
            self.next_layer, self.mlp_rows_done = self.next_layer + 1, None

    @torch.inference_mode()
    def output(self) -> torch.Tensor:
        """The final normed hidden states (every layer must have run)."""
        assert self.done, f"the pass stopped at layer {self.next_layer}"
        return self.model.norm(self.hidden)


@contextmanager
def skip_weight_init() -> Iterator[None]:
    """Build modules without their random initialisation (a second for a 135M model); every weight must be
    loaded afterwards — ``LlamaForCausalLM.load_hf_weights`` raises if any is missing."""
    saved = nn.Linear.reset_parameters, nn.Embedding.reset_parameters
    nn.Linear.reset_parameters = nn.Embedding.reset_parameters = lambda self: None
    try:
        yield
    finally:
        nn.Linear.reset_parameters, nn.Embedding.reset_parameters = saved
