"""Where pagewise keeps its files when nobody says otherwise: one per-user data directory.

Invariant: the answer depends only on the environment (`XDG_DATA_HOME`, `HOME`), never on the current directory,
so every command a user runs — from any directory — opens the same embedded database.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

from sqlalchemy.engine import make_url

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


def admin_key_file(database_url: str) -> Path:
    """Where the generated bootstrap admin key of the database at `database_url` is written when there is no
    terminal to show it on: `data_dir()/admin-keys/<backend>-<database>-<hash>.key`, one file per database (the
    hash is of the URL without its password), so a first start on another database never replaces this one's."""
    url = make_url(database_url)
    name = Path(url.database or "default").name
    readable = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{url.get_backend_name()}-{name}")
    digest = hashlib.sha256(url.render_as_string(hide_password=True).encode()).hexdigest()[:12]
    return data_dir() / "admin-keys" / f"{readable}-{digest}.key"
