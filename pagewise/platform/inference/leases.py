"""The lease heartbeat: what keeps a live request's claims alive, and what reclaims a dead process's.

Every admitted request holds two leases of `lease_s` seconds: its quota reservation (a concurrency slot and its
reserved tokens) and its row (`lease_expires_at`). This process renews both for every live job a few times per
lease, whatever the job is doing (waiting in the engine's queue included). A process that crashes stops renewing:
its slots come back when the quota leases run out, and any replica's sweep marks its rows `failed` as orphans, so
no row stays `queued` or `running` forever and no slot stays held for longer than one lease.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging

from pagewise.platform.services import PlatformServices

logger = logging.getLogger(__name__)
BEATS_PER_LEASE = 3


async def beat(services: PlatformServices) -> None:
    """One heartbeat: renew every live job's quota and row leases, then fail orphaned rows."""
    jobs = list(services.live.values())
    if jobs:
        await asyncio.gather(*(services.quotas.renew(job.reservation) for job in jobs))
        await services.requests.renew_leases([job.id for job in jobs], services.lease_expiry())
    orphans = await services.requests.fail_orphans(dt.datetime.now(dt.UTC))
    if orphans:
        logger.warning("failed %d requests orphaned by a process that stopped renewing their leases", orphans)


async def keep_leases(services: PlatformServices) -> None:
    """Beat until cancelled; a failed beat is logged and retried at the next one."""
    interval = services.quotas.lease_s / BEATS_PER_LEASE
    while True:
        await asyncio.sleep(interval)
        try:
            await beat(services)
        except Exception:  # noqa: BLE001 - a database or Redis hiccup must not stop the heartbeat
            logger.exception("lease heartbeat failed; retrying in %.0f s", interval)
