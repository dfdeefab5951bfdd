"""The dashboard over HTTP (ASGI, both databases): who may sign in, CSRF, sessions, forms, CSV, and `/schema`
working offline. The browser journey is `test_browser.py`."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import httpx
import msgspec
import pytest

from pagewise.platform.dashboard.controllers.login import NOT_ADMIN

from ..harness import MODEL, Platform, bearer
from .conftest import UI, csrf_token, sign_in

pytestmark = pytest.mark.anyio


async def _client(platform: Platform) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=platform.app), base_url="http://test", timeout=60)


async def test_only_an_admin_key_signs_in(platform: Platform) -> None:
    tenant, inference_key = await platform.tenant_with_key()
    async with await _client(platform) as http:
        refused = await sign_in(http, inference_key)
        assert refused.status_code == 403 and NOT_ADMIN in refused.text
        unknown = await sign_in(http, "pw_000000000000_nope")
        assert unknown.status_code == 401 and "Incorrect API key provided" in unknown.text
        assert "pagewise_session" not in http.cookies
        assert (await http.get(f"{UI}/tenants")).headers["location"] == f"{UI}/login"
        form = await http.get(f"{UI}/login")
        tokenless = await http.post(f"{UI}/login", data={"api_key": platform.admin_key})
        assert tokenless.status_code == 403 and "pagewise_session" not in http.cookies

        signed_in = await sign_in(http, platform.admin_key)
        assert signed_in.status_code == 303, signed_in.text
        [cookie] = [c for c in signed_in.headers.get_list("set-cookie") if c.startswith("pagewise_session=")]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/admin/ui" in cookie
        assert platform.admin_key.split("_", 2)[2] not in cookie  # the cookie is a session id, not the key
        page = await http.get(f"{UI}/tenants")
        assert page.status_code == 200 and tenant["name"] in page.text
        assert page.headers["cache-control"] == "no-store"
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert form.headers["x-frame-options"] == "DENY"


async def test_a_post_without_the_csrf_token_is_refused_and_changes_nothing(
    platform: Platform, admin_browser: httpx.AsyncClient
) -> None:
    tenant = await platform.create_tenant()
    form = {"name": tenant["name"], "weight": "5", "requests_per_minute": "7"}
    for token in (None, "forged"):
        body = form if token is None else {**form, "csrf_token": token}
        refused = await admin_browser.post(f"{UI}/tenants/{tenant['id']}", data=body)
        assert refused.status_code == 403 and "CSRF token" in refused.text
    stored = (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=bearer(platform.admin_key))).json()
    assert (stored["weight"], stored["requests_per_minute"]) == (tenant["weight"], tenant["requests_per_minute"])

    token = csrf_token((await admin_browser.get(f"{UI}/tenants/{tenant['id']}")).text)
    saved = await admin_browser.post(f"{UI}/tenants/{tenant['id']}", data={**form, "csrf_token": token})
    assert saved.status_code == 303
    stored = (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=bearer(platform.admin_key))).json()
    assert (stored["weight"], stored["requests_per_minute"], stored["tokens_per_minute"]) == (5.0, 7, None)


async def test_bad_form_input_shows_its_error_and_changes_nothing(
    platform: Platform, admin_browser: httpx.AsyncClient
) -> None:
    tenant = await platform.create_tenant()
    page = f"{UI}/tenants/{tenant['id']}"
    for field, value, message in (
        ("requests_per_minute", "lots", "requests_per_minute must be a whole number; got &#39;lots&#39;"),
        ("max_n", "0", "max_n must be between 1 and 2,147,483,647"),
        ("weight", "nan", "weight must be a finite number above 0"),
    ):
        token = csrf_token((await admin_browser.get(page)).text)
        form = {"csrf_token": token, "name": tenant["name"], "weight": "1", field: value}
        answer = await admin_browser.post(page, data=form)
        assert answer.status_code == 303 and answer.headers["location"] == page
        shown = (await admin_browser.get(page)).text
        assert message in shown, shown
    stored = (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=bearer(platform.admin_key))).json()
    assert stored == tenant


async def test_a_session_ends_with_logout_and_with_its_key(platform: Platform) -> None:
    tenant = await platform.create_tenant()
    created = await platform.http.post(
        f"/admin/tenants/{tenant['id']}/keys", json={"scopes": ["admin"]}, headers=bearer(platform.admin_key)
    )
    key = created.json()
    async with await _client(platform) as http:
        assert (await sign_in(http, key["key"])).status_code == 303
        overview = await http.get(f"{UI}/")
        assert overview.status_code == 200
        session = http.cookies["pagewise_session"]
        out = await http.post(f"{UI}/logout", data={"csrf_token": csrf_token(overview.text)})
        assert out.status_code == 303 and out.headers["location"] == f"{UI}/login"
        http.cookies.set("pagewise_session", session, domain="test", path=UI)  # a copy kept from before
        assert (await http.get(f"{UI}/")).headers["location"] == f"{UI}/login"  # deleted on the server too

        assert (await sign_in(http, key["key"])).status_code == 303
        assert (await http.get(f"{UI}/")).status_code == 200
        revoked = await platform.http.delete(
            f"/admin/tenants/{tenant['id']}/keys/{key['id']}", headers=bearer(platform.admin_key)
        )
        assert revoked.status_code == 200
        assert (await http.get(f"{UI}/")).headers["location"] == f"{UI}/login"


async def test_usage_csv_and_key_usage_count_a_request(platform: Platform, admin_browser: httpx.AsyncClient) -> None:
    tenant, key = await platform.tenant_with_key()
    done = await platform.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=bearer(key)
    )
    assert done.status_code == 200, done.text
    download = await admin_browser.get(f"{UI}/usage.csv", params={"group_by": "tenant_id", "tenant_id": tenant["id"]})
    assert download.status_code == 200 and download.headers["content-type"].startswith("text/csv")
    assert download.headers["content-disposition"].startswith('attachment; filename="pagewise-usage-1d-')
    [row] = list(csv.DictReader(io.StringIO(download.text)))
    usage = done.json()["usage"]
    assert (row["tenant_id"], int(row["num_model_requests"])) == (tenant["id"], 1)
    assert (int(row["input_tokens"]), int(row["output_tokens"])) == (usage["prompt_tokens"], usage["completion_tokens"])

    page = (await admin_browser.get(f"{UI}/tenants/{tenant['id']}")).text
    [key_row] = [part for part in page.split("<tr ")[1:] if "data-key-id" in part]
    assert '<td class="num">1</td>' in key_row  # the key's one request over 30 days
    bad = await admin_browser.get(f"{UI}/usage", params={"range": "forever"})
    assert bad.status_code == 400 and "range must be one of short, medium, long" in bad.text


async def test_tenant_page_lists_live_adapters_with_their_month_usage(
    platform: Platform, admin_browser: httpx.AsyncClient
) -> None:
    """A live adapter is listed with the model name requests use and its usage this month; a deleted one is not."""
    import datetime as dt

    from pagewise.platform.db.ids import new_id
    from pagewise.platform.db.models import Adapter, UsageDaily, utcnow

    tenant = await platform.create_tenant()
    common = {"tenant_id": tenant["id"], "base_model": MODEL, "digest": "ab" * 32, "rank": 8, "bytes": 3 * 2**20}
    async with platform.app.state.sessionmaker() as session:
        session.add(Adapter(id=new_id("adapter", "-"), name="pirate", target_modules=["q_proj", "v_proj"], **common))
        session.add(
            Adapter(id=new_id("adapter", "-"), name="gone", target_modules=["q_proj"], deleted_at=utcnow(), **common)
        )
        session.add(
            UsageDaily(
                tenant_id=tenant["id"],
                day=dt.datetime.now(dt.UTC).date(),
                model=f"{MODEL}:pirate",
                requests=3,
                prompt_tokens=1200,
                completion_tokens=34,
                cached_tokens=0,
                cost_micros=1_500_000,
            )
        )
        await session.commit()
    page = await admin_browser.get(f"{UI}/tenants/{tenant['id']}")
    assert page.status_code == 200, page.text
    [row] = [part for part in page.text.split("<tr ")[1:] if "data-adapter-id" in part]
    assert "pirate" in row and f"<code>{MODEL}:pirate</code>" in row and "q_proj, v_proj" in row and "3.0 MiB" in row
    assert '<td class="num">3</td>' in row and '<td class="num">1,234</td>' in row and "$1.500000" in row
    assert "gone" not in page.text and f"{MODEL}:gone" not in page.text

    empty = await admin_browser.get(f"{UI}/tenants/{(await platform.create_tenant())['id']}")
    assert "No adapters." in empty.text


async def test_tenant_page_lists_its_newest_batches_with_their_progress(
    platform: Platform, admin_browser: httpx.AsyncClient
) -> None:
    """A tenant's batches are listed with status, endpoint, line counts, progress and result files; another
    tenant's are not; past 20 only the 20 newest are, and the page says so. (Closed batches only: the app's batch
    runner would otherwise run the lines while the page is read.)"""
    import datetime as dt
    import re

    from pagewise.platform.db.ids import new_id
    from pagewise.platform.db.models import Batch, BatchLine, StoredFile, utcnow

    async def add_batches(tenant_id: str, count: int, lines: tuple[str, ...] = (), **fields: str) -> list[str]:
        """`count` batches of `tenant_id` (their ids, oldest first), the first with `lines` in these statuses."""
        now = utcnow()
        file = StoredFile(
            id=new_id("file", "-"),
            tenant_id=tenant_id,
            purpose="batch",
            filename="in.jsonl",
            bytes=10,
            line_count=len(lines),
            sha256="0" * 64,
        )
        ids = sorted(new_id("batch") for _ in range(count))
        async with platform.app.state.sessionmaker() as session:
            session.add(file)
            await session.flush()
            common = {
                "tenant_id": tenant_id,
                "input_file_id": file.id,
                "endpoint": "/v1/chat/completions",
                "completion_window": "24h",
                "status": "completed",
                "created_at": now,
                "expires_at": now + dt.timedelta(hours=24),
            }
            session.add_all(Batch(id=batch_id, **{**common, **fields}) for batch_id in ids)
            await session.flush()
            session.add_all(
                BatchLine(batch_id=ids[0], custom_id=f"req-{n}", line=n, body={}, status=status)
                for n, status in enumerate(lines, 1)
            )
            await session.commit()
        return ids

    tenant, other = await platform.create_tenant(), await platform.create_tenant()
    output_id = "file-0123456789ab-out"
    [batch_id] = await add_batches(
        tenant["id"], 1, ("succeeded", "succeeded", "failed", "cancelled"), status="cancelled", output_file_id=output_id
    )
    others = await add_batches(other["id"], 21)

    page = await admin_browser.get(f"{UI}/tenants/{tenant['id']}")
    assert page.status_code == 200, page.text
    [row] = [part for part in page.text.split("<tr ")[1:] if "data-batch-id" in part]
    assert f"<code>{batch_id}</code>" in row and '<span class="badge cancelled">cancelled</span>' in row
    assert "<code>/v1/chat/completions</code>" in row and f'<td><code class="small">{output_id}</code></td>' in row
    assert row.count("<td>—</td>") == 1  # no error file
    assert re.findall(r'<td class="num">([^<]*)</td>', row) == ["2", "1", "4", "75.0%"]
    assert "No batches." not in page.text and "newest batches" not in page.text
    assert not any(other_id in page.text for other_id in others)

    crowded = (await admin_browser.get(f"{UI}/tenants/{other['id']}")).text
    assert "Showing this tenant's 20 newest batches; it has more." in crowded
    assert all(other_id in crowded for other_id in others[1:]) and others[0] not in crowded
    assert batch_id not in crowded

    empty = await admin_browser.get(f"{UI}/tenants/{(await platform.create_tenant())['id']}")
    assert "No batches." in empty.text


async def test_schema_page_loads_nothing_from_another_host(platform: Platform) -> None:
    page = await platform.http.get("/schema")
    assert page.status_code == 200 and "SwaggerUIBundle" in page.text
    assert "https://" not in page.text.split("<body>")[0] and "cdn." not in page.text
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css", "swagger-ui-standalone-preset.js", "favicon-32x32.png"):
        assert (await platform.http.get(f"/schema/assets/{asset}")).status_code == 200, asset


async def test_rotate_suspend_and_find_by_id(platform: Platform, admin_browser: httpx.AsyncClient) -> None:
    tenant, key = await platform.tenant_with_key()
    page = f"{UI}/tenants/{tenant['id']}"
    listed = (await platform.http.get(f"/admin/tenants/{tenant['id']}/keys", headers=bearer(platform.admin_key))).json()
    [old] = listed
    token = csrf_token((await admin_browser.get(page)).text)
    rotated = await admin_browser.post(
        f"{page}/keys/{old['id']}/rotate", data={"csrf_token": token, "from": "tenant", "grace_period_s": "0"}
    )
    assert rotated.status_code == 200 and rotated.headers["cache-control"] == "no-store"
    new_key = rotated.text.split('id="new-key" readonly value="')[1].split('"')[0]
    assert (await platform.http.get("/v1/models", headers=bearer(key))).status_code == 401
    assert (await platform.http.get("/v1/models", headers=bearer(new_key))).status_code == 200

    suspended = await admin_browser.post(f"{page}/status", data={"csrf_token": token, "status": "suspended"})
    assert suspended.status_code == 303
    assert (await platform.http.get("/v1/models", headers=bearer(new_key))).status_code == 403
    assert f"Tenant {tenant['name']} is suspended." in (await admin_browser.get(page)).text
    await admin_browser.post(f"{page}/status", data={"csrf_token": token, "status": "active"})
    assert (await platform.http.get("/v1/models", headers=bearer(new_key))).status_code == 200

    done = await platform.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 1}, headers=bearer(new_key)
    )
    found = await admin_browser.get(f"{UI}/requests", params={"id": done.json()["id"]})
    assert found.headers["location"] == f"{UI}/requests/{done.json()['id']}"
    detail = await admin_browser.get(found.headers["location"])
    assert detail.status_code == 200 and tenant["name"] in detail.text and "Time to first token" in detail.text
    assert "not traced" in detail.text  # no OTEL_* variable here; a traced request shows its trace id
    missing = await admin_browser.get(f"{UI}/requests", params={"id": "cmpl_nope"})
    assert missing.status_code == 200 and "No request found with id 'cmpl_nope'" in missing.text
    hourly = await admin_browser.get(f"{UI}/usage", params={"bucket_width": "1h", "range": "long", "group_by": "model"})
    assert hourly.status_code == 200 and "last 168 hours" in hourly.text and MODEL in hourly.text
    bad_time = await admin_browser.get(f"{UI}/requests", params={"since": "yesterday"})
    assert bad_time.status_code == 400 and "since must be a time like" in bad_time.text


async def test_exports_page_lists_a_revision_and_downloads_its_files(
    platform: Platform, admin_browser: httpx.AsyncClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the jobs worker wrote (made here by the same `export_month`), with its spend, listed and downloaded."""
    import datetime as dt

    from pagewise.jobs.database import session_factory
    from pagewise.jobs.exports import export_month

    tenant, key = await platform.tenant_with_key()
    done = await platform.http.post(
        "/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2}, headers=bearer(key)
    )
    assert done.status_code == 200, done.text
    settings = msgspec.structs.replace(platform.services.settings, export_dir=str(tmp_path))
    monkeypatch.setattr(platform.services, "settings", settings)
    today = dt.datetime.now(dt.UTC).date()
    with session_factory(settings.database_url)() as session:
        export = export_month(session, settings.export_path, tenant["id"], today.strftime("%Y-%m"), today)
        export_id = export.id
    page = await admin_browser.get(f"{UI}/exports")
    assert page.status_code == 200 and export_id in page.text and tenant["id"] in page.text
    csv_file = await admin_browser.get(f"{UI}/exports/{export_id}/csv")
    assert csv_file.status_code == 200 and tenant["id"] in csv_file.text
    assert (await admin_browser.get(f"{UI}/exports/{export_id}/xml")).status_code == 400
    assert (await admin_browser.get(f"{UI}/exports/exp_missing/jsonl")).status_code == 404
    overview = await admin_browser.get(f"{UI}/")
    assert "Spend · 24 h" in overview.text


async def test_a_nul_in_any_form_field_is_a_400_and_changes_nothing(
    platform: Platform, admin_browser: httpx.AsyncClient
) -> None:
    """PostgreSQL stores no NUL in text: a form id holding one is refused before the handler (never a 500), on a
    signed-in POST and on the login form alike."""
    tenant, _ = await platform.tenant_with_key()
    admin = bearer(platform.admin_key)
    before = (await platform.http.get(f"/admin/tenants/{tenant['id']}/keys", headers=admin)).json()
    token = csrf_token((await admin_browser.get(f"{UI}/keys")).text)
    created = await admin_browser.post(
        f"{UI}/keys", data={"csrf_token": token, "tenant_id": f"{tenant['id']}\x00", "name": "k", "scopes": "inference"}
    )
    assert created.status_code == 400 and "NUL" in created.text, created.text
    renamed = await admin_browser.post(f"{UI}/tenants/{tenant['id']}", data={"csrf_token": token, "name": "a\x00b"})
    assert renamed.status_code == 400, renamed.text
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}/keys", headers=admin)).json() == before
    assert (await platform.http.get(f"/admin/tenants/{tenant['id']}", headers=admin)).json()["name"] == tenant["name"]
    transport = httpx.ASGITransport(app=platform.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        login = await sign_in(http, "sk-\x00")
        assert login.status_code == 400 and "NUL" in login.text, login.text
