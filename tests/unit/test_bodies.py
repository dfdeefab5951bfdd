"""A NUL character anywhere in a JSON body is a 400 naming where, before anything is converted or stored (no
database stores it: PostgreSQL refuses it in text and JSON)."""

from __future__ import annotations

import msgspec
import pytest

from pagewise.platform.bodies import parse_body
from pagewise.platform.errors import APIError


class Export(msgspec.Struct, forbid_unknown_fields=True):
    tenant_id: str
    tags: list[str] = []


@pytest.mark.parametrize(
    ("data", "param"),
    [
        ({"tenant_id": "a\x00b"}, "tenant_id"),
        ({"tenant_id": "t", "tags": ["ok", "x\x00"]}, "tags[1]"),
        ({"tenant_id": "t", "nested": {"deep": [{"v": "\x00"}]}}, "nested.deep[0].v"),
        ({"tenant_id": "t", "bad\x00key": 1}, None),
    ],
)
def test_a_nul_is_a_400_naming_where(data: dict, param: str | None) -> None:
    with pytest.raises(APIError) as raised:
        parse_body(data, Export)
    assert raised.value.status_code == 400 and raised.value.param == param
    assert "must not contain a control character; found U+0000" in raised.value.message


def test_a_deeply_nested_body_is_walked_without_recursion() -> None:
    data: object = "\x00"
    for _ in range(5000):
        data = [data]
    with pytest.raises(APIError, match="U[+]0000"):
        parse_body({"tenant_id": "t", "tags": data}, Export)


def test_bodies_without_nul_convert_as_before() -> None:
    assert parse_body({"tenant_id": "t", "tags": ["a", "b"]}, Export) == Export("t", ["a", "b"])
    assert parse_body({"tenant_id": "escaped \\u0000 text"}, Export).tenant_id == "escaped \\u0000 text"
