"""`pagewise keys …` and `pagewise tenants …` on each database: expiry, status, rotation; one-line errors."""

from __future__ import annotations

import datetime as dt
import secrets

import pytest


def _listing(cli, tenant: str) -> dict[str, str]:
    code, lines, _ = cli("keys", "list", "--tenant", tenant)
    assert code == 0
    return {line.split()[0]: line for line in lines}


def _expiry(line: str) -> dt.datetime:
    return dt.datetime.fromisoformat(line.rsplit("expires=", 1)[1])


def test_keys_create_with_expiry_list_status_and_rotate(cli) -> None:
    tenant = f"cli-{secrets.token_hex(4)}"
    assert cli("tenants", "create", tenant)[0] == 0
    code, out, err = cli("keys", "create", "--tenant", tenant, "--name", "ci", "--expires", "30d")
    assert code == 0 and len(out) == 1 and out[0].startswith("pw_") and "shown only once" in err[0]
    code, _, _ = cli("keys", "create", "--tenant", tenant, "--name", "dated", "--expires", "2099-01-31")
    assert code == 0
    cli("keys", "create", "--tenant", tenant, "--expires", "2099-01-31T12:00:00+02:00")
    listed = _listing(cli, tenant)
    assert len(listed) == 3 and all("  active  " in line for line in listed.values())
    by_name = {line.split("name=")[1].split()[0]: key_id for key_id, line in listed.items()}
    ci, dated, unnamed = by_name["'ci'"], by_name["'dated'"], by_name["''"]
    in_30_days = dt.datetime.now(dt.UTC) + dt.timedelta(days=30)
    assert abs(_expiry(listed[ci]) - in_30_days) < dt.timedelta(minutes=1)
    assert _expiry(listed[dated]) == dt.datetime(2099, 1, 31, tzinfo=dt.UTC)
    assert _expiry(listed[unnamed]) == dt.datetime(2099, 1, 31, 10, tzinfo=dt.UTC)

    code, out, err = cli("keys", "rotate", ci, "--grace-period", "1h")
    assert code == 0 and len(out) == 1 and out[0].startswith("pw_") and "shown only once" in err[0]
    after = _listing(cli, tenant)
    [new_id] = set(after) - set(listed)
    assert "name='ci'" in after[new_id] and _expiry(after[new_id]) == _expiry(listed[ci])
    in_an_hour = dt.datetime.now(dt.UTC) + dt.timedelta(hours=1)
    assert "  active  " in after[ci] and abs(_expiry(after[ci]) - in_an_hour) < dt.timedelta(minutes=1)

    assert cli("keys", "revoke", dated)[0] == 0
    assert "  revoked  " in _listing(cli, tenant)[dated]
    code, out, err = cli("keys", "rotate", dated)
    assert (code, out, len(err)) == (1, [], 1) and "is revoked and cannot be rotated" in err[0]
    code, out, _ = cli("keys", "rotate", unnamed)  # no grace: the old key is revoked at once
    assert code == 0 and "  revoked  " in _listing(cli, tenant)[unnamed]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("keys", "create", "--tenant", "{t}", "--expires", "soon"), "--expires must be an ISO-8601 date"),
        (("keys", "create", "--tenant", "{t}", "--expires", "2001-01-01"), "expires_at must be in the future"),
        (("keys", "create", "--tenant", "{t}", "--name", "a\x1bb"), "name must not contain a control character"),
        (("keys", "rotate", "key_nope", "--grace-period", "1y"), "--grace-period must be a duration"),
        (("keys", "rotate", "key_nope", "--grace-period", "8d"), "grace_period_s must be between 0 and 604,800"),
        (("tenants", "create", "bad\x00name"), "name must not contain a control character"),
        (("tenants", "update", "{t}", "--rpm", "3000000000"), "requests_per_minute must be between 0 and"),
    ],
)
def test_admin_errors_are_one_line(cli, argv: tuple[str, ...], message: str) -> None:
    tenant = f"cli-{secrets.token_hex(4)}"
    assert cli("tenants", "create", tenant)[0] == 0
    if argv[:2] == ("keys", "rotate"):
        code, out, _ = cli("keys", "create", "--tenant", tenant)
        key_id = next(iter(_listing(cli, tenant)))
        argv = (*argv[:2], key_id, *argv[3:])
    code, out, err = cli(*(a.format(t=tenant) for a in argv))
    assert (code, out, len(err)) == (1, [], 1), err
    assert err[0].startswith("error: ") and message in err[0]
