"""Request rows written straight through the store, with the times a test needs."""

from __future__ import annotations

import datetime as dt

from pagewise.platform.db.models import RequestRecord
from pagewise.platform.inference.job import new_request_id


def request_row(
    tenant_id: str, endpoint: str, queued_at: dt.datetime, *, status: str = "queued", **fields: object
) -> RequestRecord:
    """A row as admission writes it (prompt `Hi`, model `m`), queued at `queued_at`."""
    return RequestRecord(
        id=new_request_id(endpoint),
        tenant_id=tenant_id,
        endpoint=endpoint,
        model="m",
        input={"prompt": "Hi"},
        params={},
        status=status,
        queued_at=queued_at,
        **fields,
    )
