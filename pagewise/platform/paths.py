"""Where pagewise keeps its files when nobody says otherwise: one per-user data directory.

Invariant: the answer depends only on the environment (`XDG_DATA_HOME`, `HOME`), never on the current directory,
so every command a user runs — from any directory — opens the same embedded database.
"""

from __future__ import annotations

import os
from pathlib import Path

DATABASE_FILE = "pagewise.db"


def data_dir() -> Path:
    """`$XDG_DATA_HOME/pagewise`, or `~/.local/share/pagewise`; a relative `XDG_DATA_HOME` is ignored (XDG spec)."""
    base = os.environ.get("XDG_DATA_HOME", "")
    root = Path(base) if os.path.isabs(base) else Path.home() / ".local" / "share"
    return root / "pagewise"


def default_database_url() -> str:
    """The embedded SQLite database in `data_dir()`; its directory is created on first use (`ensure_data_dir`)."""
    return f"sqlite+aiosqlite:///{data_dir() / DATABASE_FILE}"


def ensure_data_dir() -> Path:
    """Create `data_dir()` (owner-only, like the secrets it may hold) if missing, and return it."""
    path = data_dir()
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path
