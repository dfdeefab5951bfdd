"""Where uploaded files' bytes live: `<files dir>/<tenant id>/<file id>.jsonl`, a folder every API replica and
worker mounts (the export folder's `files/`).

Invariants: a file appears whole or not at all (written to a temporary name in the same folder, then renamed);
its name holds only ids the platform made, never a client's filename.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


class FileStorage:
    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, tenant_id: str, file_id: str) -> Path:
        return self.root / tenant_id / f"{file_id}.jsonl"

    def write(self, tenant_id: str, file_id: str, content: bytes) -> None:
        target = self.path(tenant_id, file_id)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{file_id}.")
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(content)
            os.replace(temporary, target)
        except BaseException:
            Path(temporary).unlink(missing_ok=True)
            raise

    def read(self, tenant_id: str, file_id: str) -> bytes:
        return self.path(tenant_id, file_id).read_bytes()

    def delete(self, tenant_id: str, file_id: str) -> None:
        self.path(tenant_id, file_id).unlink(missing_ok=True)
