"""``LoRARequest``: which adapter a request runs under (vLLM's shape on the offline API)."""

from __future__ import annotations

from dataclasses import dataclass

from pagewise.engine.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter in PEFT's format in the directory ``lora_path``, named ``lora_name``, with a positive id.

    ``lora_int_id`` is how the engine recognises an adapter it has read before (as in vLLM): one id always
    stands for one directory. ``digest``, when given, is the sha256 content address the files must have
    (``adapter_files.adapter_digest``): a worker loading an adapter from shared storage checks it, so a file
    changed or damaged on the way is refused rather than served.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    digest: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise InvalidRequestError("lora_name must be a non-empty string", param="lora_request")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(
                f"lora_int_id must be a positive integer, got {self.lora_int_id!r}", param="lora_request"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise InvalidRequestError("lora_path must name a directory", param="lora_request")
