"""`export_hf_dir`: the weights pagewise runs, as an HF directory another engine (vLLM) loads. pagewise reads it
back bit for bit, and transformers reads it as the same model that it reads from the GGUF itself."""

from __future__ import annotations

import json

import pytest
import torch

from pagewise.engine.hf_export import export_hf_dir
from pagewise.engine.loader import DEFAULT_MODEL, load_model


def test_pagewise_reads_an_export_back_bit_for_bit(tmp_path, tiny_model) -> None:
    for name, model_type in (("export-llama", "llama"), ("export-qwen2", "qwen2")):
        path, _ = tiny_model(name, model_type=model_type, tie_word_embeddings=model_type == "llama")
        exported = export_hf_dir(str(path), tmp_path / name)
        source, again = load_model(str(path), progress=False), load_model(str(exported), progress=False)
        assert again.arch == source.arch
        assert again.weights.keys() == source.weights.keys()
        assert all(torch.equal(again.weights[k], source.weights[k]) for k in source.weights)
        assert again.generation_eos_token_ids == source.generation_eos_token_ids


def test_transformers_reads_the_default_models_export_as_its_own_gguf_load(tmp_path, hf_smollm2) -> None:
    import transformers

    exported = export_hf_dir(DEFAULT_MODEL, tmp_path / "smollm2")
    assert json.loads((exported / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 9690, 314, 253, 1345, 28, 2683, 30, 506]])
    with torch.no_grad():
        ours, theirs = model(ids).logits, hf_smollm2(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_an_existing_destination_is_never_overwritten(tmp_path, tiny_model) -> None:
    path, _ = tiny_model("export-llama", model_type="llama")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep").write_text("x")
    with pytest.raises(OSError):
        export_hf_dir(str(path), tmp_path / "taken")
    assert (tmp_path / "taken" / "keep").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]  # nothing half-written left beside it
