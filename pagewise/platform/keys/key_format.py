"""The key format `pw_<prefix>_<secret>`. Invariant: only the prefix and SHA-256(secret) are ever stored."""

from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec

PREFIX_BYTES = 6
SECRET_BYTES = 32


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


def parse_key(key: str) -> ParsedKey | None:
    """Split `pw_<prefix>_<secret>`; `None` for anything else. The secret may itself contain `_`."""
    parts = key.split("_", 2)
    if len(parts) != 3 or parts[0] != "pw" or len(parts[1]) != 2 * PREFIX_BYTES or not parts[2]:
        return None
    return ParsedKey(prefix=parts[1], secret=parts[2])


def secret_matches(secret: str, stored_sha256: str) -> bool:
    """Constant-time comparison of SHA-256(secret) with the stored digest."""
    return hmac.compare_digest(hash_secret(secret), stored_sha256)
