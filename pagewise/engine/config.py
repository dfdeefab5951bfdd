"""Engine arguments (vLLM's names), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagewise.engine.errors import InvalidConfigError
from pagewise.engine.gemm_selection import CHOICES as GEMM_CHOICES
from pagewise.engine.sampling_params import is_int
from pagewise.engine.scheduler import POLICIES
from pagewise.kernels.gemm import cpu_has_native_bf16

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_CHOICES = ("auto", *_DTYPES)
_DEFAULT_CPU_KV_BYTES = 2 * 1024**3


@dataclass(frozen=True, slots=True)
class Precision:
    """What an engine computes in. ``model``: its parameters and the activations between projections (the
    residual stream, norms, rotary, attention, logits); ``matmul``: the projections' weights and inputs (the
    products accumulate in fp32 and return in ``model``); ``kv_cache``: the cached keys and values."""

    model: torch.dtype
    matmul: torch.dtype
    kv_cache: torch.dtype

    @classmethod
    def uniform(cls, dtype: torch.dtype) -> Precision:
        return cls(dtype, dtype, dtype)

    def describe(self) -> dict[str, str]:
        return {part: str(getattr(self, part)).removeprefix("torch.") for part in ("model", "matmul", "kv_cache")}


@dataclass(slots=True)
class EngineConfig:
    """Everything that shapes an engine. ``None`` means "derive it": see ``resolve``.

    - ``max_model_len``: longest prompt + output; defaults to the model's context length, capped at 8,192.
    - ``max_num_batched_tokens``: the per-step token budget; ``None`` = 2,048 with chunked prefill (long prompts
      are split across steps), else ``max(2,048, max_model_len)``.
    - ``fair_max_num_batched_tokens``: under the ``fair`` policy, the step's budget while two or more tenants
      have had work within the last ``RECENT_STEPS`` steps (a tenant alone keeps the full budget): shorter steps
      while tenants share. ``None`` = the full budget: step interrupts (below) let an arrival owed service cut in
      between two parts of a layer, so sharing needs no shorter steps (docs/benchmarks.md).
    - ``kv_cache_memory_bytes``: KV budget for all layers; default 2 GiB on CPU. On CUDA the default is what
      ``gpu_memory_utilization`` leaves for it.
    - ``gpu_memory_utilization``: the fraction of the device's *total* memory this engine may use for weights,
      activations and KV cache together (vLLM's meaning): the KV cache gets ``total * gpu_memory_utilization``
      minus the memory the process took loading the weights and the peak activations of a profiled largest step
      (``max_num_batched_tokens`` tokens). Start-up fails with a clear error if that leaves nothing, or if the
      share exceeds the memory free at start-up. Ignored on CPU and when ``kv_cache_memory_bytes`` is set.
    - ``gemm_path``: the matmul path of every projection (``pagewise.kernels.gemm``): ``auto`` times the paths
      this machine has on the model's shapes and takes the fastest (cached per CPU kind; see
      ``gemm_selection``), or a path's name forces it.
    - ``dtype``: ``auto`` (bf16 projections and KV cache where the CPU multiplies bf16 natively, fp32 elsewhere;
      see ``resolve_precision``), or ``float32`` / ``bfloat16`` / ``float16`` for everything. ``float32`` is exact:
      greedy outputs equal HF transformers' fp32 token for token.
    - ``served_model_name``: the names the model is served under (vLLM's flag): the first is the name it is listed
      and reported under, the others are aliases a request may use; a comma-separated string or a sequence.
      ``None``: the ``model`` argument as given (a known name, or a path). Names hold no whitespace and no ``:``
      (reserved for ``model:adapter``).
    - ``enable_lora``: serve LoRA adapters (``LoRARequest``) batched with the base model: ``max_loras`` adapters
      resident at once (slots; least recently used evicted), of rank at most ``max_lora_rank``, and host copies
      of up to ``max_cpu_loras`` (None: ``max(max_loras, 32)``) for quick reloads (``adapter_slots``).
    - ``enable_step_interrupts``: a step may be paused between two parts of a layer for a short step of requests owed
      service ahead of it (a better priority class, or under ``fair`` a tenant far below the paused step's
      tenants; see ``scheduler``), of at most ``interrupt_max_num_batched_tokens`` tokens, at most
      ``max_interrupts_per_step`` times per step. ``force_step_interrupts`` (a test switch) interrupts at every
      layer of every step with any request outside it, without the per-step cap.
    """

    model: str = "smollm2-135m-instruct"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    fair_max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    preemption_mode: str = "recompute"
    scheduling_policy: str = "fcfs"
    swap_space_bytes: int = 1024**3
    dtype: str = "auto"
    gemm_path: str = "auto"
    device: str = "cpu"
    seed: int = 0
    cache_dir: str | None = None
    enable_step_interrupts: bool = True
    interrupt_max_num_batched_tokens: int = 256
    max_interrupts_per_step: int = 4
    force_step_interrupts: bool = False
    served_model_name: str | tuple[str, ...] | None = None
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        def fail(message: str) -> None:
            raise InvalidConfigError(message)

        if not is_int(self.block_size) or self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            fail(f"block_size must be a power of two in [1, 128], got {self.block_size}")
        if not is_int(self.max_num_seqs) or self.max_num_seqs < 1:
            fail(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and not (
            is_int(self.max_num_batched_tokens) and self.max_num_batched_tokens >= 1
        ):
            fail(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.fair_max_num_batched_tokens is not None and not (
            is_int(self.fair_max_num_batched_tokens) and self.fair_max_num_batched_tokens >= 1
        ):
            fail(f"fair_max_num_batched_tokens must be >= 1, got {self.fair_max_num_batched_tokens}")
        if self.max_model_len is not None and not (is_int(self.max_model_len) and self.max_model_len >= 2):
            fail(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and not (
            is_int(self.kv_cache_memory_bytes) and self.kv_cache_memory_bytes > 0
        ):
            fail(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        utilization = self.gpu_memory_utilization
        if isinstance(utilization, bool) or not isinstance(utilization, int | float) or not 0 < utilization <= 1:
            fail(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not is_int(self.interrupt_max_num_batched_tokens) or self.interrupt_max_num_batched_tokens < 1:
            fail(f"interrupt_max_num_batched_tokens must be >= 1, got {self.interrupt_max_num_batched_tokens}")
        if not is_int(self.max_interrupts_per_step) or self.max_interrupts_per_step < 0:
            fail(f"max_interrupts_per_step must be >= 0, got {self.max_interrupts_per_step}")
        if self.served_model_name is not None:
            self.served_model_name = _served_names(self.served_model_name)
        if not is_int(self.max_loras) or self.max_loras < 1:
            fail(f"max_loras must be >= 1, got {self.max_loras}")
        if not is_int(self.max_lora_rank) or not 1 <= self.max_lora_rank <= 512:
            fail(f"max_lora_rank must be in [1, 512], got {self.max_lora_rank}")
        if self.max_cpu_loras is not None and not (is_int(self.max_cpu_loras) and self.max_cpu_loras >= 1):
            fail(f"max_cpu_loras must be >= 1, got {self.max_cpu_loras}")
        if self.preemption_mode not in ("recompute", "swap"):
            fail(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if self.scheduling_policy not in POLICIES:
            fail(f"scheduling_policy must be 'fcfs' or 'fair', got {self.scheduling_policy!r}")
        if not is_int(self.swap_space_bytes) or self.swap_space_bytes < 0:
            fail(f"swap_space_bytes must be >= 0, got {self.swap_space_bytes}")
        if self.dtype not in DTYPE_CHOICES:
            fail(f"dtype must be one of {list(DTYPE_CHOICES)}, got {self.dtype!r}")
        if self.gemm_path not in GEMM_CHOICES:
            fail(f"gemm_path must be one of {list(GEMM_CHOICES)}, got {self.gemm_path!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            fail(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            fail(f"device {self.device!r} requested but CUDA is not available")

    def resolve_precision(self) -> Precision:
        """``dtype`` as what each part computes in. A named dtype is used for everything. ``auto`` on a CPU with
        native bf16 products (``cpu_has_native_bf16``) runs the projections in bf16 (weights and inputs; fp32
        accumulation) and keeps the KV cache in bf16 (half the bytes attention reads, twice the tokens in the same
        memory), the rest in fp32 (residual stream, norms, rotary, attention's arithmetic, logits, sampling);
        everywhere else it is fp32 throughout (fp16 is never chosen: CPUs of this kind have no native fp16
        arithmetic)."""
        if self.dtype != "auto":
            return Precision.uniform(_DTYPES[self.dtype])
        if not self.device.startswith("cuda") and cpu_has_native_bf16():
            return Precision(torch.float32, torch.bfloat16, torch.bfloat16)
        return Precision.uniform(torch.float32)

    def served_names(self, loaded_name: str) -> tuple[str, ...]:
        """The names the model answers to, the listed one first."""
        return self.served_model_name or (loaded_name,)

    def resolve_max_cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(self.max_loras, 32)

    def resolve_max_model_len(self, model_context_len: int) -> int:
        """``max_model_len`` checked against the model's context window (or derived from it)."""
        if self.max_model_len is None:
            return min(model_context_len, 8192)
        if self.max_model_len > model_context_len:
            raise InvalidConfigError(
                f"max_model_len {self.max_model_len:,} exceeds the model's context length {model_context_len:,}"
            )
        return self.max_model_len

    def resolve_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise InvalidConfigError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens:,}) is smaller than max_model_len "
                    f"({max_model_len:,}); enable chunked prefill or raise the budget"
                )
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def resolve_fair_max_num_batched_tokens(self, budget: int, max_model_len: int) -> int:
        """The shared-engine budget (see the class docstring), never above ``budget``."""
        shared = self.fair_max_num_batched_tokens
        if shared is None:
            return budget
        if not self.enable_chunked_prefill and shared < max_model_len:
            raise InvalidConfigError(
                f"fair_max_num_batched_tokens ({shared:,}) is smaller than max_model_len ({max_model_len:,}); "
                "enable chunked prefill or raise it"
            )
        return min(shared, budget)

    def resolve_kv_cache_bytes(self) -> int | None:
        """``kv_cache_memory_bytes`` if set, else the CPU default; None on CUDA, where the engine measures the
        budget once the weights are loaded (``pagewise.engine.kv_budget``)."""
        if self.kv_cache_memory_bytes is not None:
            return self.kv_cache_memory_bytes
        if self.device.startswith("cuda"):
            return None
        return _DEFAULT_CPU_KV_BYTES


def _served_names(value: object) -> tuple[str, ...]:
    """``served_model_name`` as a tuple of distinct valid names."""
    if isinstance(value, str):
        names = tuple(part.strip() for part in value.split(","))
    elif isinstance(value, list | tuple) and all(isinstance(n, str) for n in value):
        names = tuple(value)
    else:
        raise InvalidConfigError(f"served_model_name must be a name or a list of names, got {value!r}")
    for name in names:
        if not name or name != name.strip() or any(c.isspace() for c in name) or ":" in name:
            raise InvalidConfigError(
                f"served_model_name: {name!r} is not a valid name (non-empty, no whitespace, no ':')"
            )
    if not names or len(set(names)) != len(names):
        raise InvalidConfigError(f"served_model_name must list distinct names, got {value!r}")
    return names
