"""The key format `pw_<prefix>_<secret>`. Invariant: only the prefix and SHA-256(secret) are ever stored."""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

import msgspec

PREFIX_BYTES = 6
SECRET_BYTES = 32
MIN_GIVEN_SECRET_LENGTH = 32  # a key chosen by an operator (`PAGEWISE_ADMIN_KEY`) has at least this many
_PREFIX = re.compile(f"[0-9a-f]{{{2 * PREFIX_BYTES}}}")
_SECRET = re.compile(r"[A-Za-z0-9_-]+")
_EXAMPLE = 'python -c "import secrets; print(f\'pw_{secrets.token_hex(6)}_{secrets.token_urlsafe(32)}\')"'


class ParsedKey(msgspec.Struct, frozen=True):
    prefix: str
    secret: str


class NewKey(msgspec.Struct, frozen=True):
    """A freshly generated key: `key` is shown to the caller once, the rest is stored."""

    key: str
    prefix: str
    secret_sha256: str


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def generate_key() -> NewKey:
    prefix = secrets.token_hex(PREFIX_BYTES)
    secret = secrets.token_urlsafe(SECRET_BYTES)
    return NewKey(key=f"pw_{prefix}_{secret}", prefix=prefix, secret_sha256=hash_secret(secret))


def key_from_string(key: str) -> NewKey:
    """A key chosen by an operator, checked like one we would generate; `ValueError` says what is wrong.

    The message never repeats the key: it may end up in logs.
    """
    parsed = parse_key(key)
    if parsed is None:
        problem = "it is not of the form pw_<prefix>_<secret>"
    elif not _PREFIX.fullmatch(parsed.prefix):
        problem = f"its prefix must be {2 * PREFIX_BYTES} lowercase hexadecimal digits"
    elif not _SECRET.fullmatch(parsed.secret):
        problem = "its secret may contain only letters, digits, '-' and '_'"
    elif len(parsed.secret) < MIN_GIVEN_SECRET_LENGTH:
        problem = f"its secret has {len(parsed.secret)} characters; at least {MIN_GIVEN_SECRET_LENGTH} are needed"
    else:
        return NewKey(key=key, prefix=parsed.prefix, secret_sha256=hash_secret(parsed.secret))
    raise ValueError(f"The admin key (PAGEWISE_ADMIN_KEY) is malformed: {problem}. Generate one with: {_EXAMPLE}")


def parse_key(key: str) -> ParsedKey | None:
    """Split `pw_<prefix>_<secret>`; `None` for anything else. The secret may itself contain `_`."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != "pw" or len(parts[1]) != 2 * PREFIX_BYTES or not parts[2]:
        return None
    return ParsedKey(prefix=parts[1], secret=parts[2])


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of SHA-256(secret) with the stored digest."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)
