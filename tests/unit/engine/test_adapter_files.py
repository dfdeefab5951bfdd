"""Adapter files (``adapter_files``): what is accepted, what each bad adapter is refused with, and that the
torch-free reader gives exactly the tensors safetensors' own torch loader gives."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import save as save_tensors

from pagewise.engine.adapter_files import AdapterError, adapter_digest, parse_adapter, projection_shapes
from pagewise.engine.model_config import ModelArchConfig

ARCH = ModelArchConfig(
    vocab_size=100, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
    head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=256,
    tie_word_embeddings=True, attention_bias=False,
)  # fmt: skip


def config(**overrides) -> bytes:
    return json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "down_proj"]}
                      | overrides).encode()  # fmt: skip


def tensors(rank=4, arch=ARCH, dtype=torch.float32, targets=("q_proj", "down_proj")) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = projection_shapes(arch)
    out = {}
    for layer in range(arch.num_layers):
        for proj in targets:
            module = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{module}.{proj}"
            d_in, d_out = shapes[proj]
            out[f"{prefix}.lora_A.weight"] = torch.randn(rank, d_in, generator=gen).to(dtype)
            out[f"{prefix}.lora_B.weight"] = torch.randn(d_out, rank, generator=gen).to(dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
def test_accepts_peft_files_and_reads_every_dtype_exactly(dtype) -> None:
    weights = tensors(dtype=dtype)
    raw = save_tensors(weights)
    adapter = parse_adapter(config(), raw, ARCH, max_rank=16)
    assert adapter.rank == 4 and adapter.scaling == 2.0 and adapter.targets == ("down_proj", "q_proj")
    assert len(adapter.weights) == 4 and adapter.digest == adapter_digest(config(), raw)
    a, b = adapter.weights[(1, "down_proj")]
    prefix = "base_model.model.model.layers.1.mlp.down_proj"
    assert np.array_equal(a, weights[f"{prefix}.lora_A.weight"].float().numpy())
    assert np.array_equal(b, weights[f"{prefix}.lora_B.weight"].float().numpy())


def test_rslora_scaling_and_all_linear() -> None:
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    raw = save_tensors(tensors(targets=every))
    adapter = parse_adapter(config(use_rslora=True, target_modules="all-linear"), raw, ARCH, max_rank=4)
    assert adapter.scaling == 8 / math.sqrt(4) and len(adapter.weights) == 14


OTHER_BASE = dataclasses.replace(ARCH, hidden_size=96, intermediate_size=192)


def nan_weights() -> bytes:
    weights = tensors()
    weights["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][3, 1] = float("nan")
    return save_tensors(weights)


def missing_half() -> bytes:
    weights = tensors()
    del weights["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
    return save_tensors(weights)


@pytest.mark.parametrize(
    ("config_bytes", "weights", "message"),
    [
        (b"{not json", lambda: save_tensors(tensors()), "not valid JSON"),
        (config(r=32), lambda: save_tensors(tensors(rank=32)), "rank 32 is above this engine's max_lora_rank 16"),
        (config(target_modules=["q_proj", "embed_tokens"]), lambda: save_tensors(tensors()), "unknown target"),
        (config(use_dora=True), lambda: save_tensors(tensors()), "use_dora"),
        (config(), nan_weights, "NaN or infinite"),
        (config(), lambda: save_tensors(tensors(arch=OTHER_BASE)), "another base model"),
        (config(), missing_half, "must both be present"),
        (config(), lambda: b"\x10\x00\x00\x00\x00\x00\x00\x00{}", "truncated"),
        (config(), lambda: save_tensors(tensors(targets=("q_proj", "down_proj", "up_proj"))), "not among"),
        (config(peft_type="PREFIX_TUNING"), lambda: save_tensors(tensors()), "peft_type"),
    ],
    ids=["json", "rank", "target", "dora", "nan", "other-base", "half", "truncated", "untargeted", "peft-type"],
)
def test_refuses_each_bad_adapter_naming_the_problem(config_bytes, weights, message) -> None:
    with pytest.raises(AdapterError, match=message):
        parse_adapter(config_bytes, weights(), ARCH, max_rank=16)


def test_a_layer_the_base_model_lacks() -> None:
    weights = tensors()
    weights["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = torch.zeros(4, 64)
    weights["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = torch.zeros(64, 4)
    with pytest.raises(AdapterError, match="has 2 layers"):
        parse_adapter(config(), save_tensors(weights), ARCH, max_rank=16)
