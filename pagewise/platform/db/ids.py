"""Public ids: a type prefix, then 12 hex digits of milliseconds and 16 random hex digits.

Invariant: ids of one type sort by creation time, so an id doubles as a pagination cursor.
"""

import secrets
import time


def new_id(prefix: str, separator: str = "_") -> str:
    """A fresh time-ordered id such as `ten_0193a1b2c3d4e5f60718293a4b5c6d7e` (`separator="-"`: OpenAI's shape
    for the objects it names, `chatcmpl-…`)."""
    return f"{prefix}{separator}{time.time_ns() // 1_000_000:012x}{secrets.token_hex(8)}"
