"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest
import torch

from pagewise import EngineConfig
from pagewise.engine.model_runner import KVCache


@pytest.fixture(scope="session")
def paged_config(tiny_model):
    """Factory: ``paged_config(name, block_size, num_blocks, **engine_args)`` is an ``EngineConfig`` for the tiny
    model ``name`` whose fp32 KV cache holds exactly ``num_blocks`` blocks of ``block_size`` tokens (fp32
    throughout unless ``engine_args`` names a dtype: the exact path)."""

    def make(name: str, block_size: int, num_blocks: int, **engine_args) -> EngineConfig:
        path, model = tiny_model(name)
        cfg = model.config
        per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, block_size, cfg.num_key_value_heads,
                                            cfg.hidden_size // cfg.num_attention_heads, torch.float32)
        return EngineConfig(model=str(path), block_size=block_size, kv_cache_memory_bytes=num_blocks * per_block,
                            **({"dtype": "float32"} | engine_args))

    return make
