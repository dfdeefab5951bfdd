"""The rule for names people give tenants and keys, checked in the services (so the CLI gets it too).

A name is stored stripped of surrounding whitespace, is at most `MAX_NAME_LENGTH` characters (the column's
size) and contains no control characters (NUL, newlines, escapes) and no unpaired surrogates, so it prints
on one line and every database stores it as sent.
"""

from __future__ import annotations

import unicodedata

from pagewise.platform.errors import invalid_request

MAX_NAME_LENGTH = 200
_FORBIDDEN_CATEGORIES = {"Cc": "a control character", "Cs": "an unpaired surrogate"}


def clean_name(value: str, *, param: str = "name", allow_empty: bool = False) -> str:
    """`value` stripped, or a 400 naming `param` if it breaks the rule (or is empty unless allowed)."""
    name = value.strip()
    if not name and not allow_empty:
        raise invalid_request(f"{param} must not be empty", param=param)
    if len(name) > MAX_NAME_LENGTH:
        raise invalid_request(
            f"{param} must be at most {MAX_NAME_LENGTH} characters; got {len(name):,}", param=param
        )
    for position, char in enumerate(name):
        what = _FORBIDDEN_CATEGORIES.get(unicodedata.category(char))
        if what is not None:
            raise invalid_request(
                f"{param} must not contain {what}; found U+{ord(char):04X} at position {position}",
                param=param,
            )
    return name
