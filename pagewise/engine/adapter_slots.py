"""Adapter slots: a fixed number of LoRA adapters resident in the model's projections, loaded and evicted
least-recently-used while the engine runs, with host copies of recently used adapters for a quick reload.

Every targetable projection of the model holds a stack of ``max_loras`` slots (``kernels.lora``): ``lora_a``
``[max_loras, parts × max_lora_rank, in]`` and ``lora_b`` ``[max_loras, out, parts × max_lora_rank]``, in the
projection's compute dtype. An adapter is known by its key: its content digest (``adapter_files``), prefixed with
its owner's tenant id when it has one (``register``).

Invariants: an adapter is in at most one slot; a slot with a pin (a running request under its adapter) is never
evicted or rewritten — so a step's forward pass, paused or not, reads slots that stay as they were when it was
scheduled; ``scalings[slot]`` is the scaling of the adapter in that slot. A slot's weights are written only by
``acquire``, which the scheduler calls as a request starts running.
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import torch

from pagewise.engine.adapter_files import CONFIG_FILE, WEIGHTS_FILE, AdapterError, AdapterWeights, parse_adapter
from pagewise.engine.errors import InvalidRequestError
from pagewise.engine.lora_request import LoRARequest
from pagewise.engine.model_config import ModelArchConfig
from pagewise.engine.models.llama import LlamaForCausalLM, LoraProjection
from pagewise.kernels.lora import LoraBatch


def read_adapter(lora_request: LoRARequest, arch: ModelArchConfig, max_rank: int) -> AdapterWeights:
    """The adapter in ``lora_request.lora_path``, checked (``adapter_files.parse_adapter``) and, when the request
    names a digest, verified to be exactly those files."""
    directory = Path(lora_request.lora_path)
    try:
        config_bytes = (directory / CONFIG_FILE).read_bytes()
        weights_bytes = (directory / WEIGHTS_FILE).read_bytes()
    except OSError as error:
        raise AdapterError(
            f"adapter {lora_request.lora_name!r}: cannot read {CONFIG_FILE} and {WEIGHTS_FILE} in "
            f"{lora_request.lora_path!r} ({error.strerror or error})"
        ) from None
    adapter = parse_adapter(config_bytes, weights_bytes, arch, max_rank)
    if lora_request.digest is not None and adapter.digest != lora_request.digest:
        raise AdapterError(
            f"adapter {lora_request.lora_name!r}: its files hash to {adapter.digest[:12]}…, not the expected "
            f"{lora_request.digest[:12]}… (changed or damaged)"
        )
    return adapter


class AdapterSlots:
    def __init__(
        self,
        model: LlamaForCausalLM,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        device: torch.device,
    ) -> None:
        self.arch = model.arch
        self.max_loras, self.max_lora_rank, self.max_cpu_loras = max_loras, max_lora_rank, max_cpu_loras
        self.device = device
        self.projections: list[LoraProjection] = model.lora_projections()
        for projection in self.projections:
            projection.allocate(max_loras, max_lora_rank)
        self.scalings = [0.0] * max_loras
        self._slot_of: dict[str, int] = {}  # key -> slot
        self._lru: OrderedDict[int, str] = OrderedDict()  # occupied slots, least recently acquired first
        self._pins = [0] * max_loras
        self._host: OrderedDict[str, AdapterWeights] = OrderedDict()  # key -> weights, least recently used first
        self._sources: dict[str, LoRARequest] = {}  # key -> where to read it again
        self._known: dict[int, tuple[str, str]] = {}  # lora_int_id -> (path, digest)
        self.loads = 0  # adapters written into a slot
        self.reads = 0  # adapters read from their files

    # ---- registration (the engine's add_request)

    def register(self, lora_request: LoRARequest, owner: str | None = None) -> str:
        """The key ``lora_request``'s adapter is known by for ``owner`` (a tenant; None: no tenant): its digest, or
        ``<owner>/<digest>``. Its files are read and checked unless its id is known (an ``AdapterError`` changes
        nothing). Owners never share a slot or a host copy, even of identical files: whether an adapter is resident
        is never visible to another tenant through its latency."""
        known = self._known.get(lora_request.lora_int_id)
        if known is not None and known[0] != lora_request.lora_path:
            raise InvalidRequestError(
                f"lora_int_id {lora_request.lora_int_id} already names the adapter in {known[0]!r}",
                param="lora_request",
            )
        adapter = None
        if known is None or lora_request.digest not in (None, known[1]):
            adapter = read_adapter(lora_request, self.arch, self.max_lora_rank)
            self.reads += 1
            self._known[lora_request.lora_int_id] = (lora_request.lora_path, adapter.digest)
        digest = self._known[lora_request.lora_int_id][1]
        key = digest if owner is None else f"{owner}/{digest}"
        self._sources[key] = lora_request
        if adapter is not None:
            self._keep_on_host(key, adapter)
        return key

    def _keep_on_host(self, key: str, adapter: AdapterWeights) -> None:
        self._host[key] = adapter
        self._host.move_to_end(key)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_copy(self, key: str) -> AdapterWeights:
        adapter = self._host.get(key)
        if adapter is None:  # not read for this owner, or evicted from host memory: read it (its files are known)
            adapter = read_adapter(self._sources[key], self.arch, self.max_lora_rank)
            self.reads += 1
        self._keep_on_host(key, adapter)
        return adapter

    # ---- slots (the scheduler)

    def can_acquire(self, key: str) -> bool:
        """Whether a request under ``key`` could start now: its adapter is in a slot, or a slot is free or
        holds an adapter no running request uses."""
        return key in self._slot_of or len(self._lru) < self.max_loras or any(p == 0 for p in self._pins)

    def acquire(self, key: str) -> None:
        """Pin ``key``'s slot for one more running request, loading the adapter (into a free slot, else over
        the least recently used unpinned one) if it is not resident. Requires ``can_acquire``."""
        slot = self._slot_of.get(key)
        if slot is None:
            slot = self._free_slot()
            self._load(slot, self._host_copy(key))
            self._slot_of[key] = slot
        self._lru[slot] = key
        self._lru.move_to_end(slot)
        self._pins[slot] += 1

    def release(self, key: str) -> None:
        """One running request under ``key`` stopped running (it stays resident until evicted)."""
        slot = self._slot_of[key]
        assert self._pins[slot] > 0, f"slot {slot} released more often than acquired"
        self._pins[slot] -= 1

    def slot_of(self, key: str) -> int:
        return self._slot_of[key]

    def resident(self) -> dict[str, int]:
        """Resident adapters' keys and their pins (running requests)."""
        return {key: self._pins[slot] for slot, key in self._lru.items()}

    def _free_slot(self) -> int:
        used = set(self._lru)
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        for slot, key in self._lru.items():  # least recently acquired first
            if self._pins[slot] == 0:
                del self._lru[slot], self._slot_of[key]
                return slot
        raise RuntimeError("no adapter slot is free or unpinned (acquire without can_acquire)")

    @torch.inference_mode()
    def _load(self, slot: int, adapter: AdapterWeights) -> None:
        for projection in self.projections:
            projection.write(slot, adapter)
        self.scalings[slot] = adapter.scaling
        self.loads += 1

    # ---- a step (the model runner)

    def batch(self, row_slots: list[int]) -> LoraBatch | None:
        """The step's ``LoraBatch`` for rows using ``row_slots`` (-1: the base model)."""
        return LoraBatch.build(row_slots, self.scalings, self.device)
