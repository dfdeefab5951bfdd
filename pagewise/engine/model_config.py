"""The shape of a Llama-family decoder, read from an HF ``config.json`` (or built by the GGUF loader)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> the HF architectures class name that goes with it
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """Shape of a Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2).

    Invariants (checked on construction): every size is positive, ``num_heads`` is a multiple of
    ``num_kv_heads`` (grouped-query attention), ``head_dim`` is even (RoPE rotates halves), and
    ``rope_scaling`` is either ``None`` (plain RoPE) or an HF-style dict with a ``"rope_type"`` other than
    ``"default"`` and without ``rope_theta`` (that lives in ``rope_theta``). ``attention_bias`` means q/k/v
    projections carry a bias (Qwen2); the output projection never does. ``max_position_embeddings`` is the
    longest context the model is exact for: for a sliding-window model it is capped at the window, where full
    attention and windowed attention agree.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool

    def __post_init__(self) -> None:
        sizes = {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_layers": self.num_layers,
            "num_heads": self.num_heads,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
        }
        for name, value in sizes.items():
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for RoPE, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("model config: rms_norm_eps and rope_theta must be positive")
        if self.rope_scaling is not None and (
            self.rope_scaling.get("rope_type") in (None, "default") or "rope_theta" in self.rope_scaling
        ):
            raise ValueError(f"model config: malformed rope_scaling {self.rope_scaling!r}")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelArchConfig:
        """Build from a ``config.json`` dict (transformers v4 or v5 layout).

        Accepts ``model_type`` llama, mistral or qwen2 (and, when present, only the matching
        ``architectures``); anything else raises ``ValueError``. Defaults follow transformers:
        ``head_dim = hidden // heads``, ``num_kv_heads = heads``, ``rope_theta = 10000``. RoPE parameters come
        from ``rope_theta`` + ``rope_scaling`` (v4) or ``rope_parameters`` (v5).
        """
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}: pagewise runs Llama-family decoders "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        architectures = cfg.get("architectures") or [SUPPORTED_MODEL_TYPES[model_type]]
        if architectures != [SUPPORTED_MODEL_TYPES[model_type]]:
            raise ValueError(
                f"unsupported architectures {architectures!r} for model_type {model_type!r}: "
                f"expected [{SUPPORTED_MODEL_TYPES[model_type]!r}]"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}: only 'silu' is implemented")
        if cfg.get("mlp_bias"):
            raise ValueError("unsupported config: mlp_bias=True (Llama-family MLPs here have no bias)")
        if model_type == "qwen2":
            attention_bias = bool(cfg.get("attention_bias", True))
        elif cfg.get("attention_bias"):
            # HF Llama/Mistral put the bias on o_proj too, which the model does not implement.
            raise ValueError(f"unsupported config: attention_bias=True for model_type {model_type!r}")
        else:
            attention_bias = False

        hidden_size = int(cfg["hidden_size"])
        num_heads = int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _rope_from_hf(cfg)
        max_positions = int(cfg.get("max_position_embeddings", 2048))
        window = _sliding_window(cfg, model_type)
        if window is not None:
            max_positions = min(max_positions, window)
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden_size,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden_size // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from v4 keys (``rope_theta``, ``rope_scaling``) or v5's
    ``rope_parameters``."""
    params = dict(cfg.get("rope_parameters") or {})
    if cfg.get("rope_scaling"):
        params.update(cfg["rope_scaling"])
    theta = float(cfg.get("rope_theta") or params.pop("rope_theta", None) or 10000.0)
    params.pop("rope_theta", None)
    if "type" in params:  # older configs spell it "type"
        params.setdefault("rope_type", params.pop("type"))
    if params.get("rope_type", "default") == "default":
        return theta, None
    return theta, params


def _sliding_window(cfg: dict[str, Any], model_type: str) -> int | None:
    """The attention window the model was trained with, or ``None`` when every layer attends fully."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        return None
    return int(window)
