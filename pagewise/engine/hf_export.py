"""Write a model pagewise loads (a known name, a GGUF file, an HF directory) as a plain fp32 HF directory.

What another engine needs to run the very weights pagewise runs (``pagewise bench vllm``): ``config.json``
(the architecture as transformers names it), ``model.safetensors`` (HF tensor names; no ``lm_head.weight``
when the embeddings are tied) and the tokenizer files. Invariant: ``load_model(export_dir)`` gives back the same
architecture and bit-identical weights as ``load_model(model)``, and transformers reads the directory as the
same model (tests check both).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from pagewise.engine.loader import LoadedModel, load_model
from pagewise.engine.model_config import SUPPORTED_MODEL_TYPES, ModelArchConfig


def hf_config(arch: ModelArchConfig, eos_token_ids: tuple[int, ...]) -> dict[str, Any]:
    """``config.json`` for `arch`: a Llama decoder, or Qwen2 when the q/k/v projections carry a bias (the only
    Llama-family variant that has one)."""
    model_type = "qwen2" if arch.attention_bias else "llama"
    config: dict[str, Any] = {
        "model_type": model_type,
        "architectures": [SUPPORTED_MODEL_TYPES[model_type]],
        "vocab_size": arch.vocab_size,
        "hidden_size": arch.hidden_size,
        "intermediate_size": arch.intermediate_size,
        "num_hidden_layers": arch.num_layers,
        "num_attention_heads": arch.num_heads,
        "num_key_value_heads": arch.num_kv_heads,
        "head_dim": arch.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta,
        "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": "float32",
        "eos_token_id": list(eos_token_ids) if len(eos_token_ids) > 1 else eos_token_ids[0],
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


def export_hf_dir(model: str, dest: Path) -> Path:
    """Write `model` as an fp32 HF directory at `dest` (replacing nothing: the directory is written under a
    temporary name and renamed into place, so a half-written export is never found); returns `dest`."""
    loaded: LoadedModel = load_model(model, dtype=torch.float32, progress=False)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        save_file({k: v.contiguous() for k, v in loaded.weights.items()}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        config = hf_config(loaded.arch, loaded.generation_eos_token_ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        loaded.tokenizer.save(tmp)
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
