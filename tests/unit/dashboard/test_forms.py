"""Form text → service bodies: empty quotas are no limit, bad text is a 400 naming its field."""

from __future__ import annotations

import datetime as dt

import pytest
from litestar.datastructures import FormMultiDict

from pagewise.platform.dashboard import forms
from pagewise.platform.errors import APIError


def _form(*pairs: tuple[str, str]) -> FormMultiDict:
    return FormMultiDict(list(pairs))


def test_tenant_fields() -> None:
    body = forms.tenant_create(
        _form(("name", " acme "), ("weight", "2.5"), ("requests_per_minute", "1,000"), ("tokens_per_minute", ""))
    )
    assert (body.name, body.weight, body.requests_per_minute, body.tokens_per_minute) == ("acme", 2.5, 1000, None)
    assert body.max_n is None  # every quota the form leaves empty is no limit


@pytest.mark.parametrize(
    ("pairs", "param"),
    [
        ((("weight", "1"), ("max_n", "two")), "max_n"),
        ((("weight", "heavy"),), "weight"),
        ((("weight", "1"), ("requests_per_minute", "1.5")), "requests_per_minute"),
    ],
)
def test_unreadable_numbers_name_their_field(pairs: tuple[tuple[str, str], ...], param: str) -> None:
    with pytest.raises(APIError) as error:
        forms.tenant_update(_form(("name", "acme"), *pairs))
    assert (error.value.status_code, error.value.param) == (400, param)


def test_key_fields() -> None:
    body = forms.key_create(
        _form(("name", "ci"), ("scopes", "inference"), ("scopes", "admin"), ("expires_at", "2030-01-02T03:04"))
    )
    assert body.scopes == ["inference", "admin"]
    assert body.expires_at == dt.datetime(2030, 1, 2, 3, 4, tzinfo=dt.UTC)  # the form's time is UTC
    with pytest.raises(APIError, match="unknown scope 'root'"):
        forms.key_create(_form(("scopes", "root")))
    with pytest.raises(APIError, match="expires_at must be a time like"):
        forms.key_create(_form(("scopes", "inference"), ("expires_at", "tomorrow")))


def test_statuses() -> None:
    assert forms.tenant_status(_form(("status", "suspended"))).status == "suspended"
    with pytest.raises(APIError, match="status must be one of active, suspended"):
        forms.tenant_status(_form(("status", "deleted")))
    assert forms.request_status("") is None
    with pytest.raises(APIError, match="status must be one of queued"):
        forms.request_status("done")
