"""How many bytes the KV cache may take on a CUDA device.

``gpu_memory_utilization`` is the fraction of the device's *total* memory this engine may use for everything —
weights, activations and KV cache (vLLM's meaning). The KV cache gets the rest of that share once the weights
are on the device and a forward pass over the largest step has been profiled::

    kv_bytes = total * utilization - (device memory this process took since start-up + peak activation memory)

Memory other processes hold is not charged to this engine, but the share must fit in what was free at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagewise.engine.errors import InvalidConfigError


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """A reading of ``torch.cuda.mem_get_info``: free and total bytes of the device."""

    free: int
    total: int

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total)


def peak_activation_bytes(device: torch.device, forward: Callable[[], None]) -> int:
    """Bytes ``forward()`` allocates at its peak beyond what was allocated before; its cached blocks are given
    back to the device afterwards, so a following ``DeviceMemory.read`` sees only what stays allocated."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    forward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    return peak


def cuda_kv_cache_bytes(
    utilization: float, at_start: DeviceMemory, after_load: DeviceMemory, activation_bytes: int
) -> int:
    """The KV budget: this engine's share of the device minus what its weights, CUDA allocations and peak
    activations take (``at_start`` was read before the weights were loaded, ``after_load`` after profiling)."""
    share = int(at_start.total * utilization)
    if share > at_start.free:
        raise InvalidConfigError(
            f"gpu_memory_utilization={utilization} asks for {share:,} bytes of the device's {at_start.total:,}, "
            f"but only {at_start.free:,} were free at start-up (other processes or this process's CUDA context "
            "hold the rest); lower gpu_memory_utilization or free the device"
        )
    used = (at_start.free - after_load.free) + activation_bytes
    budget = share - used
    if budget <= 0:
        raise InvalidConfigError(
            f"gpu_memory_utilization={utilization} gives this engine {share:,} bytes of the device's "
            f"{at_start.total:,}, but the weights and the largest step's activations already take {used:,}; "
            "raise gpu_memory_utilization, lower max_num_batched_tokens or set kv_cache_memory_bytes"
        )
    return budget
