"""The adapter store: tenants' LoRA adapters in PEFT's format, each under its content address, in a folder every
API replica and worker mounts (`adapters/` in the export folder; the compose stack shares it as a volume).

Layout: `<root>/<digest>/adapter_config.json` + `adapter_model.safetensors`, where `digest` is
`adapter_files.adapter_digest` of the two files. The API writes a directory once the upload passed every check;
workers read it when a request under the adapter arrives, and the engine verifies the digest as it loads, so a file
changed or damaged in the store is refused, never served.

Invariants: a directory appears whole or not at all (written under a temporary name beside it, then renamed);
one digest's directory always holds the same bytes, so tenants who upload identical files share it on disk
(never in the engine: slots and host copies are per tenant, `AdapterSlots.register`); the names in it are
digests the platform computed, never a client's filename. Whoever stores a digest's files and records a user
of them, or counts a digest's users and removes its files, holds that digest's lock (`lock`) throughout, so a
deletion never removes files an upload of identical bytes has just recorded.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from pagewise.engine.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from pagewise.engine.lora_request import LoRARequest
from pagewise.serving.protocol import AdapterRef


class AdapterStore:
    def __init__(self, root: Path) -> None:
        self.root = root

    def directory(self, digest: str) -> Path:
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"not an adapter digest: {digest!r}")
        return self.root / digest

    def lock(self, digest: str) -> int:
        """Block until the caller holds `digest`'s lock: an exclusive `flock` on `<root>/.locks/<digest>`, so API
        replicas sharing the store and requests of one process alike take turns. Returns the open descriptor;
        closing it releases the lock. (Lock files stay: one empty file per digest ever stored.)"""
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(locks / self.directory(digest).name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def write(self, digest: str, config: bytes, weights: bytes) -> None:
        """Store an adapter's files under `digest` (already computed from them); a no-op when they are there."""
        target = self.directory(digest)
        if target.is_dir():
            return
        self.root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=self.root, prefix=f".{digest[:16]}."))
        try:
            (staging / CONFIG_FILE).write_bytes(config)
            (staging / WEIGHTS_FILE).write_bytes(weights)
            os.rename(staging, target)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not target.is_dir():  # another writer of the same digest winning the rename is success
                raise

    def read(self, digest: str, filename: str) -> bytes:
        if filename not in (CONFIG_FILE, WEIGHTS_FILE):
            raise ValueError(f"an adapter holds {CONFIG_FILE} and {WEIGHTS_FILE}, not {filename!r}")
        return (self.directory(digest) / filename).read_bytes()

    def delete(self, digest: str) -> None:
        shutil.rmtree(self.directory(digest), ignore_errors=True)

    def lora_request(self, adapter: AdapterRef) -> LoRARequest:
        """The engine's `LoRARequest` for `adapter`: its store directory, verified against its digest on load. Its
        id is derived from that directory's path (63 bits of its hash), so one id always names one directory —
        whichever store object, host or restart asks — and the engine reads each stored adapter once (per
        tenant)."""
        directory = str(self.directory(adapter.digest))
        digest = hashlib.blake2b(directory.encode(), digest_size=8).digest()
        lora_int_id = (int.from_bytes(digest, "big") >> 1) or 1
        return LoRARequest(adapter.id, lora_int_id, directory, adapter.digest)
