"""The orphan sweep: what ends the rows of an engine that stopped.

Every admitted request's row carries a lease (`lease_expires_at`). The engine running it — in this process or in
a worker — renews that lease and the quota reservation's a few times per lease (`pagewise.serving.host`). An
engine that dies stops renewing: its quota slots come back when their leases run out, and this sweep, run by
every API replica, marks its rows `failed`, so no row stays `queued` or `running` forever. In distributed mode a
dead worker's requests are redelivered to a live one first, which renews their leases before they expire.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from pagewise.platform.requests.store import RequestStore

logger = logging.getLogger(__name__)


async def sweep(requests: RequestStore) -> int:
    """Fail the unfinished rows whose lease expired; returns how many."""
    orphans = await requests.fail_orphans(dt.datetime.now(dt.UTC))
    if orphans:
        logger.warning("failed %d requests orphaned by an engine that stopped renewing their leases", orphans)
    return orphans


async def keep_sweeping(requests: RequestStore, interval_s: float) -> None:
    """Sweep every `interval_s` until cancelled; a failed sweep is logged and retried at the next one."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await sweep(requests)
        except Exception:  # noqa: BLE001 - a database hiccup must not stop the sweep
            logger.exception("orphan sweep failed; retrying in %.0f s", interval_s)
