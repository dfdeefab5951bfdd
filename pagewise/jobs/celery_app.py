"""The Celery app: Redis broker and result backend under the platform's key prefix, tasks and their schedule.

Delivery is at least once and every task is idempotent, so redelivery is safe. A task is acknowledged late,
after it ran, and a worker takes one task at a time (`prefetch_multiplier=1`). Its state is `STARTED` while it
runs (`track_started`; the result names the process running it). When it does not run to its end:
- its pool process dies (killed, out of memory): the worker sends it again as a retry after
  `WORKER_LOST_RETRY_DELAY_S`, at most `WORKER_LOST_RETRIES` times (`retry_on_worker_lost`; a task that kills its
  process every time ends `FAILURE` rather than looping), and puts the message back as it was if that send fails
  (`reject_on_worker_lost`);
- the whole worker dies: the broker hands the unacknowledged message out again after
  `PAGEWISE_JOBS_VISIBILITY_TIMEOUT_S`, which `configure` requires to exceed every task's hard time limit — so a
  task still running is never handed to a second worker;
- it outlives its hard time limit: its process is killed and it ends `FAILURE`, acknowledged, not retried.
Every task runs in its own span (`pagewise.jobs.tracing`).
"""

from __future__ import annotations

from celery import Celery
from celery.schedules import crontab

from pagewise.jobs.tracing import TracedTask
from pagewise.platform.settings import Settings, SettingsError

TIME_LIMITS_S = {  # (soft, hard): the soft limit raises in the task, the hard one kills its process
    "pagewise.check_usage": (120, 150),
    "pagewise.export_month": (240, 300),
    "pagewise.export_all": (60, 90),
    "pagewise.purge_bodies": (540, 600),
}
SCHEDULE = {
    "usage-check-hourly": {"task": "pagewise.check_usage", "schedule": crontab(minute=5), "kwargs": {"days_ago": 0}},
    "usage-check-daily": {
        "task": "pagewise.check_usage",
        "schedule": crontab(hour=0, minute=30),
        "kwargs": {"days_ago": 1},
    },
    "billing-exports-monthly": {
        "task": "pagewise.export_all",
        "schedule": crontab(day_of_month=1, hour=1, minute=0),
        "kwargs": {},
    },
    "retention-daily": {"task": "pagewise.purge_bodies", "schedule": crontab(hour=2, minute=0)},
}
WORKER_LOST_RETRIES = 3
WORKER_LOST_RETRY_DELAY_S = 5

app = Celery("pagewise", include=["pagewise.jobs.tasks"], task_cls=TracedTask)
_settings: list[Settings] = []  # the settings `configure` was given, read by the tasks


def configure(settings: Settings) -> Celery:
    """Point the app at the settings' Redis and database (`celery_config`). A process takes one broker (Celery
    keeps its connections): configuring again with the same broker settings is a no-op, with another broker a
    `RuntimeError`."""
    if _settings:
        if _broker(_settings[0]) != _broker(settings):
            raise RuntimeError("the jobs' Celery app is already configured with another broker in this process")
        return app
    app.conf.update(celery_config(settings))
    _settings[:] = [settings]
    return app


def celery_config(settings: Settings) -> dict[str, object]:
    """The app's configuration for `settings`; a `SettingsError` without Redis or with a visibility timeout a task
    could outlast."""
    if settings.redis_url is None:
        raise SettingsError("the jobs need PAGEWISE_REDIS_URL (their broker)")
    longest = max(hard for _, hard in TIME_LIMITS_S.values())
    if settings.jobs_visibility_timeout_s <= longest:
        raise SettingsError(
            f"PAGEWISE_JOBS_VISIBILITY_TIMEOUT_S must exceed the longest job time limit ({longest} s); "
            f"got {settings.jobs_visibility_timeout_s}"
        )
    prefix = settings.redis_key_prefix
    transport = {"global_keyprefix": prefix, "visibility_timeout": settings.jobs_visibility_timeout_s}
    annotations = {
        name: {
            "soft_time_limit": soft,
            "time_limit": hard,
            "max_retries": WORKER_LOST_RETRIES,
            "default_retry_delay": WORKER_LOST_RETRY_DELAY_S,
        }
        for name, (soft, hard) in TIME_LIMITS_S.items()
    }
    return {
        "broker_url": settings.redis_url,
        "result_backend": settings.redis_url,
        "broker_transport_options": transport,
        "result_backend_transport_options": {"global_keyprefix": prefix},
        "task_default_queue": "pagewise-jobs",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_retry_on_worker_lost": True,
        "task_track_started": True,
        "worker_prefetch_multiplier": 1,
        "task_annotations": annotations,
        "result_expires": 86400,
        "beat_schedule": SCHEDULE,
        "timezone": "UTC",
        "enable_utc": True,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
    }


def _broker(settings: Settings) -> tuple[object, ...]:
    return settings.redis_url, settings.redis_key_prefix, settings.jobs_visibility_timeout_s


def settings() -> Settings:
    """The settings this process was configured with."""
    if not _settings:
        raise RuntimeError("pagewise.jobs.celery_app.configure was not called in this process")
    return _settings[0]
