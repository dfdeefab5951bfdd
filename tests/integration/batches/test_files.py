"""The Files API for batch input: an upload is checked whole (size, purpose, JSONL shape, distinct custom_ids,
line count) before anything is stored; a file is its tenant's alone (another tenant's id is a 404, like a missing
or deleted one); content comes back byte for byte; delete removes the bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncSession

from pagewise.platform.db.models import StoredFile
from pagewise.platform.files.batch_input import MAX_LINES

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio
MAX_FILE_BYTES = 64 * 1024


@pytest.fixture
def platform_settings(tmp_path: Path) -> dict:
    return {"export_dir": str(tmp_path / "exports"), "max_file_bytes": MAX_FILE_BYTES}


def batch_line(custom_id: str, content: str = "Say hi", **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def jsonl(lines: list) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def upload(platform: Platform, key: str, content: bytes, purpose: str = "batch", name: str = "in.jsonl"):
    return await platform.http.post(
        "/v1/files", files={"file": (name, content, "application/jsonl")}, data={"purpose": purpose},
        headers=bearer(key),
    )


async def test_upload_list_read_download_delete(platform: Platform) -> None:
    _, key = await platform.tenant_with_key()
    content = jsonl([batch_line("a"), batch_line("b")])
    created = await upload(platform, key, content)
    assert created.status_code == 200, created.text
    file = created.json()
    assert file["object"] == "file" and file["id"].startswith("file-") and file["purpose"] == "batch"
    assert (file["bytes"], file["filename"], file["status"]) == (len(content), "in.jsonl", "processed")
    second = (await upload(platform, key, jsonl([batch_line("c")]), name="two.jsonl")).json()

    listed = (await platform.http.get("/v1/files", headers=bearer(key))).json()
    assert [f["id"] for f in listed["data"]] == [second["id"], file["id"]] and not listed["has_more"]
    page = (await platform.http.get("/v1/files", params={"limit": 1}, headers=bearer(key))).json()
    assert [f["id"] for f in page["data"]] == [second["id"]] and page["has_more"]
    rest = (await platform.http.get("/v1/files", params={"after": page["last_id"]}, headers=bearer(key))).json()
    assert [f["id"] for f in rest["data"]] == [file["id"]]
    assert (await platform.http.get(f"/v1/files/{file['id']}", headers=bearer(key))).json() == file
    downloaded = await platform.http.get(f"/v1/files/{file['id']}/content", headers=bearer(key))
    assert downloaded.status_code == 200 and downloaded.content == content

    deleted = await platform.http.delete(f"/v1/files/{file['id']}", headers=bearer(key))
    assert deleted.json() == {"id": file["id"], "deleted": True, "object": "file"}
    for path in (f"/v1/files/{file['id']}", f"/v1/files/{file['id']}/content"):
        assert (await platform.http.get(path, headers=bearer(key))).status_code == 404
    tenant_folder = platform.services.settings.files_path
    assert [p.name for p in tenant_folder.rglob("*.jsonl")] == [f"{second['id']}.jsonl"]
    remaining = (await platform.http.get("/v1/files", headers=bearer(key))).json()["data"]
    assert [f["id"] for f in remaining] == [second["id"]]


async def test_another_tenants_file_is_a_404(platform: Platform) -> None:
    _, owner = await platform.tenant_with_key()
    _, other = await platform.tenant_with_key()
    file = (await upload(platform, owner, jsonl([batch_line("a")]))).json()
    for method, path in (("GET", ""), ("GET", "/content"), ("DELETE", "")):
        response = await platform.http.request(method, f"/v1/files/{file['id']}{path}", headers=bearer(other))
        assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"
    assert (await platform.http.get("/v1/files", headers=bearer(other))).json()["data"] == []
    assert (await platform.http.get(f"/v1/files/{file['id']}", headers=bearer(owner))).status_code == 200


@pytest.mark.parametrize(
    ("content", "purpose", "message"),
    [
        (b'{"custom_id": "a", "method": "POST"\n', "batch", "line 1: not valid JSON"),
        (jsonl([batch_line("a"), batch_line("a")]), "batch", "line 2: custom_id 'a' is used by an earlier line"),
        (jsonl([{**batch_line("a"), "url": "/v1/embeddings"}]), "batch", "line 1: url must be one of"),
        (jsonl([{**batch_line("a"), "method": "GET"}]), "batch", "line 1: method must be 'POST'"),
        (jsonl([{**batch_line("a"), "body": "hi"}]), "batch", "line 1: body must be a JSON object"),
        (jsonl([[1, 2]]), "batch", "line 1: each line must be a JSON object"),
        (b"\n\n", "batch", "the file holds no request"),
        (b"\xff\xfe", "batch", "not UTF-8"),
        (b"x" * (MAX_FILE_BYTES + 1), "batch", f"at most {MAX_FILE_BYTES:,} are allowed"),
        (jsonl([batch_line("a")]), "fine-tune", "purpose must be 'batch'"),
    ],
)
async def test_a_bad_upload_is_a_400_and_stores_nothing(
    platform: Platform, session: AsyncSession, content: bytes, purpose: str, message: str
) -> None:
    tenant, key = await platform.tenant_with_key()
    response = await upload(platform, key, content, purpose)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] in ("file", "purpose")
    count = select(func.count()).select_from(StoredFile).where(StoredFile.tenant_id == tenant["id"])
    assert await session.scalar(count) == 0
    folder = platform.services.settings.files_path / tenant["id"]
    assert not folder.exists() or not any(folder.iterdir())


def test_more_lines_than_a_batch_takes_are_refused() -> None:
    """50,001 lines (each as short as a valid line gets) do not fit the test's size limit, so the line limit is
    checked on the reader itself."""
    from pagewise.platform.files.batch_input import BatchInputError, read_batch_input

    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {}})
    lines = "\n".join(line.replace('"x"', f'"{i}"') for i in range(MAX_LINES + 1)).encode()
    with pytest.raises(BatchInputError, match="holds 50,001 requests; at most 50,000"):
        read_batch_input(lines)
    assert len(read_batch_input(lines.rsplit(b"\n", 1)[0])) == MAX_LINES
