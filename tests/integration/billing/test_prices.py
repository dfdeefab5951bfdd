"""`/admin/prices` and `pagewise prices`: versions are added, never changed; bad input is a clear error that
writes nothing; both take the same names and units (dollars per million tokens) and store exact micro-dollars."""

from __future__ import annotations

import datetime as dt
import secrets

import pytest

from pagewise.serving.money import format_dollars, parse_dollars

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio


def _model() -> str:
    return f"model-{secrets.token_hex(4)}"


async def _prices(platform: Platform, model: str) -> list[dict]:
    response = await platform.http.get("/admin/prices", params={"model": model}, headers=bearer(platform.admin_key))
    assert response.status_code == 200, response.text
    return response.json()


async def test_create_and_list_versions_newest_first(platform: Platform) -> None:
    model, admin = _model(), bearer(platform.admin_key)
    later = (dt.datetime.now(dt.UTC) + dt.timedelta(days=30)).replace(microsecond=0)
    first = await platform.http.post(
        "/admin/prices", json={"model": model, "input": 0.15, "output": "0.6"}, headers=admin
    )
    assert first.status_code == 201, first.text
    assert {k: first.json()[k] for k in ("input", "cached_input", "output", "batch_percent")} == {
        "input": 0.15, "cached_input": 0.15, "output": 0.6, "batch_percent": 50  # cached defaults to input
    }
    second = await platform.http.post(
        "/admin/prices",
        json={
            "model": model,
            "input": 0.1,
            "cached_input": 0.05,
            "output": 0.4,
            "batch_percent": 25,
            "effective_from": later.isoformat(),
        },
        headers=admin,
    )
    assert second.status_code == 201, second.text
    listed = await _prices(platform, model)
    assert [p["id"] for p in listed] == [second.json()["id"], first.json()["id"]]
    assert dt.datetime.fromisoformat(listed[0]["effective_from"]) == later and listed[0]["batch_percent"] == 25


@pytest.mark.parametrize(
    ("change", "param", "status"),
    [
        ({"effective_from": "2000-01-01T00:00:00Z"}, "effective_from", 400),
        ({"cached_input": 0.2}, "cached_input", 400),
        ({"input": -1}, "input", 400),
        ({"output": 0.0000001}, "output", 400),  # finer than a micro-dollar
        ({"output": "0.1234567"}, "output", 400),
        ({"output": "six"}, "output", 400),
        ({"output": 2_000_000}, "output", 400),  # over $1,000,000 per million tokens
        ({"output": True}, "output", 400),
        ({"output_per_mtok_micros": 400_000}, "output_per_mtok_micros", 400),  # micro-dollars are storage only
        ({"model": "  "}, "model", 400),
        ({"currency": "eur"}, "currency", 400),
        ({"batch_percent": 101}, "batch_percent", 400),
        ({"batch_percent": 0.5}, "batch_percent", 400),
    ],
)
async def test_bad_prices_are_400s_naming_the_field_and_write_nothing(
    platform: Platform, change: dict, param: str, status: int
) -> None:
    model = _model()
    body = {"model": model, "input": 0.1, "output": 0.4, **change}
    response = await platform.http.post("/admin/prices", json=body, headers=bearer(platform.admin_key))
    assert (response.status_code, response.json()["error"]["param"]) == (status, param), response.text
    assert await _prices(platform, model) == []


async def test_same_model_and_moment_is_a_409(platform: Platform) -> None:
    when = (dt.datetime.now(dt.UTC) + dt.timedelta(days=1)).isoformat()
    body = {"model": _model(), "input": 1, "output": 2, "effective_from": when}
    admin = bearer(platform.admin_key)
    assert (await platform.http.post("/admin/prices", json=body, headers=admin)).status_code == 201
    clash = await platform.http.post("/admin/prices", json=body, headers=admin)
    assert (clash.status_code, clash.json()["error"]["code"]) == (409, "price_exists")


async def test_prices_need_the_admin_scope(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    assert (await platform.http.get("/admin/prices", headers=bearer(key))).status_code == 403


def test_dollars_convert_exactly() -> None:
    assert parse_dollars("0.15", "--input") == 150_000
    assert parse_dollars("12", "--input") == 12_000_000
    assert parse_dollars("0.000001", "--input") == 1
    assert format_dollars(1_234_567) == "1.234567"
    for bad in ("0.0000001", "-1", "abc", "nan", "inf"):
        with pytest.raises(ValueError, match="--input"):
            parse_dollars(bad, "--input")


@pytest.fixture
def pagewise_cli(database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]):
    """Run the top-level `pagewise` command line on the test's database; (exit code, stdout, stderr lines)."""
    from pagewise.cli import main

    monkeypatch.setenv("PAGEWISE_DATABASE_URL", database_url)

    def run(*argv: str) -> tuple[int, list[str], list[str]]:
        code = main(list(argv))
        out, err = capsys.readouterr()
        return code, out.splitlines(), err.splitlines()

    return run


async def test_a_price_reads_back_exactly_as_it_was_set(platform: Platform) -> None:
    """Every amount with at most 6 decimals survives the number → micro-dollars → number round trip."""
    model, admin = _model(), bearer(platform.admin_key)
    body = {"model": model, "input": 123456.654321, "cached_input": "0.000001", "output": 999999.999999}
    created = await platform.http.post("/admin/prices", json=body, headers=admin)
    assert created.status_code == 201, created.text
    assert [created.json()[k] for k in ("input", "cached_input", "output")] == [123456.654321, 0.000001, 999999.999999]


def test_cli_sets_and_lists_prices_in_dollars(pagewise_cli) -> None:
    model = _model()
    code, out, _ = pagewise_cli("prices", "set", model, "--input", "0.15", "--output", "0.6", "--cached-input", "0.075")
    assert code == 0 and "input $0.150000  cached $0.075000  output $0.600000" in out[0]
    code, out, _ = pagewise_cli("prices", "list", "--model", model)
    assert code == 0 and len(out) == 1 and model in out[0]
    code, _, err = pagewise_cli("prices", "set", model, "--input", "0.1234567", "--output", "1")
    assert code == 1 and err == [
        "error: input must be a non-negative dollar amount with at most 6 decimals; got '0.1234567'"
    ]
    code, _, err = pagewise_cli("prices", "set", model, "--input", "1", "--output", "1", "--effective-from", "soon")
    assert code == 1 and "--effective-from must be an ISO-8601 datetime" in err[0]
    assert len(pagewise_cli("prices", "list", "--model", model)[1]) == 1
