"""Strict request bodies: the one place a decoded JSON body becomes a Struct.

Litestar converts bodies with msgspec's lax rules (`"inf"` → a float, `"10"` → an int). Handlers therefore take
`data: StrictBody[T]` — the OpenAPI document still shows `T` — and call `parse_body(data, T)`, which converts
without any coercion. Unknown fields are refused by the Structs themselves (`forbid_unknown_fields=True`), and
the 400 names the field, so a misspelt or unsupported parameter is never silently ignored. A NUL character
anywhere in the body (a value or a key) is a 400 naming where: no database stores it (PostgreSQL refuses it in
text and JSON), and a body that reaches a handler reaches the database.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, TypeVar

import msgspec
from litestar.enums import RequestEncodingType
from litestar.params import Body, SkipValidation

from pagewise.platform.errors import invalid_request

T = TypeVar("T")
StrictBody = Annotated[SkipValidation[T], Body(media_type=RequestEncodingType.JSON)]
"""A JSON body passed to the handler as decoded JSON; `parse_body` turns it into `T`."""

_UNKNOWN_FIELD = re.compile(r"^Object contains unknown field `([^`]+)`(?: - at `\$(.*)`)?$")
_MISSING_FIELD = re.compile(r"^Object missing required field `([^`]+)`(?: - at `\$(.*)`)?$")
_AT = re.compile(r" - at `\$(.*)`$")


def parse_body(data: Any, kind: type[T]) -> T:
    """`data` as `kind`, strictly: wrong types, unknown fields, out-of-range values or a NUL character are a 400
    naming the field."""
    nul = _nul_at(data, "")
    if nul is not None:
        where, position = nul
        raise invalid_request(
            f"{where or 'the body'} must not contain a control character; found U+0000 at position {position}",
            param=where or None,
            code="invalid_request",
        )
    try:
        return msgspec.convert(data, kind, strict=True)
    except msgspec.ValidationError as error:
        message, param = _describe(str(error))
        raise invalid_request(message, param=param, code="invalid_request") from None


def _nul_at(value: Any, path: str) -> tuple[str, int] | None:
    """Where the first NUL in `value` is: the dotted path of its string (a key's: its object's path) and its
    position in that string; None without one. Iterative: a deeply nested body cannot exhaust the stack."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if "\x00" in item:
                return where, item.index("\x00")
        elif isinstance(item, dict):
            for key, child in item.items():
                if isinstance(key, str) and "\x00" in key:
                    return where, key.index("\x00")
                stack.append((child, f"{where}.{key}" if where else str(key)))
        elif isinstance(item, list):  # numbers (token ids) are skipped without building their paths
            stack.extend(
                (child, f"{where}[{index}]") for index, child in enumerate(item) if isinstance(child, str | dict | list)
            )
    return None


def _describe(message: str) -> tuple[str, str | None]:
    """An OpenAI-style message and the dotted path of the offending field from a msgspec error."""
    unknown = _UNKNOWN_FIELD.match(message)
    if unknown:
        field, where = unknown.group(1), _dotted(unknown.group(2) or "")
        param = f"{where}.{field}" if where else field
        return f"Unrecognized request argument supplied: {param}", param
    missing = _MISSING_FIELD.match(message)
    if missing:
        field, where = missing.group(1), _dotted(missing.group(2) or "")
        return message, f"{where}.{field}" if where else field
    at = _AT.search(message)
    if at is None:
        return message, None
    return message, _dotted(at.group(1)) or None


def _dotted(path: str) -> str:
    """msgspec's `$.messages[0].role` suffix (without `$`) as `messages[0].role`."""
    return path.lstrip(".")
