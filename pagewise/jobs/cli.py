"""`pagewise jobs worker | beat` — registered into the top-level CLI by `register`.

Both read the platform's settings (`PAGEWISE_REDIS_URL` is the broker, `PAGEWISE_DATABASE_URL` the database);
a setting they cannot start with is one `error: …` line and exit status 2. Celery loads only when they run.
The worker traces its jobs when OpenTelemetry's variables ask for it (service `pagewise-jobs`), set up before
its pool processes fork, so each inherits the exporter.
"""

from __future__ import annotations

import argparse
import sys

from pagewise.platform.cli import add_database_url_argument
from pagewise.platform.settings import Settings, SettingsError


def register(subparsers: argparse._SubParsersAction) -> None:
    jobs = subparsers.add_parser("jobs", help="background jobs (Celery)").add_subparsers(
        dest="jobs_command", required=True
    )
    worker = jobs.add_parser("worker", help="run jobs: usage checks, billing exports, retention")
    worker.add_argument("--concurrency", type=int, default=2, help="job processes (default 2)")
    worker.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    add_database_url_argument(worker)
    worker.set_defaults(func=_worker)
    beat = jobs.add_parser("beat", help="queue the scheduled jobs (run exactly one)")
    beat.add_argument("--schedule-file", help="where beat remembers the last runs (default: <data dir>/celerybeat)")
    beat.add_argument("--loglevel", default="info", choices=["debug", "info", "warning", "error"])
    add_database_url_argument(beat)
    beat.set_defaults(func=_beat)


def _configured(args: argparse.Namespace):
    from pagewise.jobs.celery_app import configure

    return configure(Settings.from_env(database_url=args.database_url))


def _worker(args: argparse.Namespace) -> int:
    from pagewise.tracing import configure_from_env

    try:
        app = _configured(args)
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    configure_from_env("pagewise-jobs")
    options = [
        f"--loglevel={args.loglevel}",
        f"--concurrency={args.concurrency}",
        "--without-gossip",
        "--without-mingle",
    ]
    app.worker_main(["worker", *options])
    return 0


def _beat(args: argparse.Namespace) -> int:
    from pagewise.platform.paths import ensure_data_dir

    try:
        app = _configured(args)
    except SettingsError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    schedule = args.schedule_file or str(ensure_data_dir() / "celerybeat")
    app.start(["beat", f"--loglevel={args.loglevel}", f"--schedule={schedule}"])
    return 0
