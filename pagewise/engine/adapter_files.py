"""LoRA adapters in PEFT's format (``adapter_config.json`` + ``adapter_model.safetensors``), read and checked
against a base model without torch, so that an API replica validates an upload exactly as a worker loads it.

An adapter is accepted only when every check passes; nothing is kept of one that fails. Checks: the config is a
LoRA config this engine computes exactly as PEFT does (no DoRA, no bias, no ``modules_to_save``, no per-module
rank or alpha patterns, no ``fan_in_fan_out``); its rank is at most the engine's ``max_lora_rank``; its target
modules are among the decoder's seven projections; every tensor is named
``…model.layers.<i>.<self_attn|mlp>.<proj>.lora_<A|B>.weight`` for a layer the base model has, has the shape
that projection and the rank call for (``A``: ``[r, in]``, ``B``: ``[out, r]``), is floating point and finite;
every targeted projection has both halves.

Scaling follows PEFT: ``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass

import numpy as np

from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.model_config import ModelArchConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# the projections an adapter may target, and the module (self_attn or mlp) each lives in
PROJECTIONS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}
_TENSOR_NAME = re.compile(
    r"(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight"
)
_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64}


class AdapterError(InvalidRequestError):
    """An adapter that cannot be served on this base model; the message names the problem."""


def projection_shapes(arch: ModelArchConfig) -> dict[str, tuple[int, int]]:
    """Each targetable projection's (in_features, out_features) in ``arch``."""
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    hidden, inter = arch.hidden_size, arch.intermediate_size
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


@dataclass(frozen=True, slots=True)
class AdapterWeights:
    """A checked adapter: rank, scaling, and for each (layer, projection) it targets its ``A`` ``[r, in]`` and
    ``B`` ``[out, r]`` in float32 (bf16 and fp16 widen exactly). ``digest`` is the sha256 of the two files'
    bytes (config, then weights): the adapter's identity, which salts prefix-cache hashes and names stored
    copies."""

    rank: int
    scaling: float
    targets: tuple[str, ...]
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    digest: str


def adapter_digest(config_bytes: bytes, weights_bytes: bytes) -> str:
    """The content address of an adapter: sha256 over its config's and its weights' bytes."""
    h = hashlib.sha256()
    for part in (config_bytes, weights_bytes):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def parse_adapter(
    config_bytes: bytes, weights_bytes: bytes, arch: ModelArchConfig, max_rank: int
) -> AdapterWeights:
    """Check an adapter's two files against ``arch`` and ``max_rank``; raises ``AdapterError`` naming the first
    problem found."""
    rank, scaling, targets = _parse_config(config_bytes, max_rank)
    tensors = _read_safetensors(weights_bytes)
    shapes = projection_shapes(arch)
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, array in tensors.items():
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise AdapterError(f"adapter tensor {name!r} is not a LoRA weight of a decoder projection")
        layer, module, proj, half = int(match[1]), match[2], match[3], match[4]
        if PROJECTIONS.get(proj) != module:
            raise AdapterError(f"adapter tensor {name!r}: unknown target module {module}.{proj}")
        if proj not in targets:
            raise AdapterError(f"adapter tensor {name!r}: {proj} is not among the config's target_modules")
        if layer >= arch.num_layers:
            raise AdapterError(f"adapter tensor {name!r}: the base model has {arch.num_layers} layers")
        in_features, out_features = shapes[proj]
        expected = (rank, in_features) if half == "A" else (out_features, rank)
        if array.shape != expected:
            raise AdapterError(
                f"adapter tensor {name!r} has shape {list(array.shape)}, the base model needs {list(expected)} "
                f"(rank {rank}): is the adapter for another base model?"
            )
        if not np.isfinite(array).all():
            raise AdapterError(f"adapter tensor {name!r} holds NaN or infinite values")
        halves.setdefault((layer, proj), {})[half] = array
    weights = {}
    for key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {key[0]} {key[1]}: lora_A and lora_B must both be present")
        weights[key] = (pair["A"], pair["B"])
    if not weights:
        raise AdapterError("the adapter holds no LoRA weights")
    return AdapterWeights(
        rank, scaling, tuple(sorted(targets)), weights, adapter_digest(config_bytes, weights_bytes)
    )


def _parse_config(config_bytes: bytes, max_rank: int) -> tuple[int, float, frozenset[str]]:
    try:
        config = json.loads(config_bytes)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type must be 'LORA', got {config.get('peft_type')!r}")
    rank = config.get("r")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"r must be a positive integer, got {rank!r}")
    if rank > max_rank:
        raise AdapterError(f"rank {rank} is above this engine's max_lora_rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not math.isfinite(alpha):
        raise AdapterError(f"lora_alpha must be a number, got {alpha!r}")
    unsupported = {
        "use_dora": bool(config.get("use_dora")),
        "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
        "bias": config.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(config.get("modules_to_save")),
        "rank_pattern": bool(config.get("rank_pattern")),
        "alpha_pattern": bool(config.get("alpha_pattern")),
    }
    for option, used in unsupported.items():
        if used:
            raise AdapterError(f"adapter option {option}={config.get(option)!r} is not supported")
    raw_targets = config.get("target_modules")
    if raw_targets == "all-linear":
        targets = frozenset(PROJECTIONS)
    elif isinstance(raw_targets, list) and raw_targets and all(isinstance(t, str) for t in raw_targets):
        targets = frozenset(t.rsplit(".", 1)[-1] for t in raw_targets)
        unknown = sorted(targets - set(PROJECTIONS))
        if unknown:
            raise AdapterError(
                f"unknown target modules {unknown}: an adapter may target {sorted(PROJECTIONS)}"
            )
    else:
        raise AdapterError(f"target_modules must be a list of projection names, got {raw_targets!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling), targets


def _read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    """The tensors of a safetensors file as float32 arrays (``__metadata__`` ignored)."""
    if len(data) < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated")
    (header_len,) = struct.unpack("<Q", data[:8])
    if header_len > len(data) - 8:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated (its header says {header_len:,} bytes)")
    try:
        header = json.loads(data[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file") from None
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} is not a safetensors file")
    body = memoryview(data)[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (begin, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {name!r} has a malformed header entry") from None
        if dtype not in _DTYPES:
            raise AdapterError(f"adapter tensor {name!r} has dtype {dtype}; expected F32, F16, BF16 or F64")
        numpy_dtype = np.dtype(_DTYPES[dtype])
        count = math.prod(shape)
        if not (0 <= begin <= end <= len(body)) or end - begin != count * numpy_dtype.itemsize:
            raise AdapterError(f"{WEIGHTS_FILE}: tensor {name!r} lies outside the file or has the wrong size")
        raw = np.frombuffer(body[begin:end], dtype=numpy_dtype)
        # bf16 is the upper half of a float32
        array = (raw.astype(np.uint32) << 16).view(np.float32) if dtype == "BF16" else raw.astype(np.float32)
        tensors[name] = array.reshape(shape)
    return tensors
