"""`pagewise serve | db upgrade | tenants … | keys …` — registered into the top-level CLI by `register`.

Engine flags on `serve` and `--database-url` on every command override `PAGEWISE_*` variables only when given;
admin commands work on the configured database directly (no server needed). A command that cannot start — a bad
setting, a database it cannot open, a port already taken — prints one `error: …` line and exits 2 before it
loads anything slow; a database is only ever printed with its password hidden.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import functools
import re
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from pagewise.exit_status import ExitStatus
from pagewise.platform.errors import APIError, invalid_request
from pagewise.platform.paths import default_database_url, ensure_data_dir
from pagewise.platform.redis_check import RedisUnreachableError
from pagewise.platform.settings import EngineSettings, Settings, SettingsError

_DURATION = re.compile(r"(\d+)([smhd])")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_QUOTA_FLAGS = {
    "requests_per_minute": "--rpm",
    "tokens_per_minute": "--tpm",
    "monthly_token_budget": "--monthly-token-budget",
    "max_concurrent_requests": "--max-concurrent",
    "max_tokens_per_request": "--max-tokens-per-request",
    "max_n": "--max-n",
}


def register(
    subparsers: argparse._SubParsersAction, add_engine_arguments: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Add `serve`, `db`, `tenants` and `keys` to a `pagewise` subparsers object; each takes `--database-url`.
    `add_engine_arguments`: the engine's flags, which `serve` takes too (`pagewise.cli` owns them)."""
    serve = add_command(
        subparsers, "serve", serve_command, "run the API server (the engine in this process unless --workers-external)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    serve.add_argument(
        "--workers-external",
        action="store_true",
        help="load no model: `pagewise worker` processes run the engine, reached through PAGEWISE_REDIS_URL",
    )
    add_engine_arguments(serve)
    serve.set_defaults(**dict.fromkeys(EngineSettings.__struct_fields__))

    db = subparsers.add_parser("db", help="database schema").add_subparsers(dest="db_command", required=True)
    add_command(db, "upgrade", db_upgrade_command, "apply Alembic migrations up to head")
    _register_tenants(subparsers)
    _register_keys(subparsers)


def _register_tenants(subparsers: argparse._SubParsersAction) -> None:
    tenants = subparsers.add_parser("tenants", help="manage tenants").add_subparsers(
        dest="tenants_command", required=True
    )
    create = add_command(tenants, "create", in_session(_tenants_create), "create a tenant")
    create.add_argument("name")
    _add_quota_flags(create)
    _add_weight_flag(create)
    add_command(tenants, "list", in_session(_tenants_list), "list tenants")
    update = add_command(
        tenants, "update", in_session(_tenants_update), "change a tenant's quotas, weight or status (-1 = no limit)"
    )
    update.add_argument("name")
    update.add_argument("--status", choices=["active", "suspended"])
    _add_quota_flags(update)
    _add_weight_flag(update)


def _register_keys(subparsers: argparse._SubParsersAction) -> None:
    keys = subparsers.add_parser("keys", help="manage API keys").add_subparsers(
        dest="keys_command", required=True
    )
    key_create = add_command(keys, "create", in_session(_keys_create), "create a key and print it (shown once)")
    key_create.add_argument("--tenant", required=True, help="tenant name")
    key_create.add_argument("--scope", action="append", choices=["inference", "admin"], dest="scopes")
    key_create.add_argument("--name", default="")
    key_create.add_argument(
        "--expires",
        help="when the key stops working: an ISO-8601 date or datetime (UTC unless it has an offset),"
        " or a duration from now such as 30d, 12h or 90m",
    )
    key_list = add_command(
        keys, "list", in_session(_keys_list), "list keys (never their secrets) with their status and expiry"
    )
    key_list.add_argument("--tenant", help="tenant name")
    revoke = add_command(keys, "revoke", in_session(_keys_revoke), "revoke a key by id")
    revoke.add_argument("key_id")
    rotate = add_command(
        keys, "rotate", in_session(_keys_rotate), "replace a key by a new one (printed once) with its name and scopes"
    )
    rotate.add_argument("key_id")
    rotate.add_argument(
        "--grace-period",
        default="0",
        help="how long the old key keeps working, e.g. 30m or 1h (default 0: revoked at once; at most 7d)",
    )


def add_command(
    group: argparse._SubParsersAction, name: str, func: Callable[[argparse.Namespace], int], help_text: str
) -> argparse.ArgumentParser:
    """A subcommand that runs `func` and, like every command here, takes `--database-url`."""
    parser = group.add_parser(name, help=help_text)
    add_database_url_argument(parser)
    parser.set_defaults(func=func)
    return parser


def add_database_url_argument(parser: argparse.ArgumentParser) -> None:
    """`--database-url`: wins over `PAGEWISE_DATABASE_URL`, whose default is the per-user embedded database."""
    parser.add_argument(
        "--database-url",
        help=f"the database (default: PAGEWISE_DATABASE_URL, else {default_database_url()})",
    )


def _add_quota_flags(parser: argparse.ArgumentParser) -> None:
    for field, flag in _QUOTA_FLAGS.items():
        parser.add_argument(flag, dest=field, type=int, help=field.replace("_", " "))


def _add_weight_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--weight", type=float, help="scheduling weight (tier): 2 gets twice the engine time of 1 (default 1)"
    )


class StartupError(Exception):
    """A command cannot start; its message is the one line printed after `error: `."""


_STARTUP_ERRORS = (StartupError, SettingsError, RedisUnreachableError)


def _exits_2_on_startup_error(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """One `error: …` line on stderr and exit status 2 for a command that cannot start, never a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except _STARTUP_ERRORS as error:
            print(f"error: {error}", file=sys.stderr)
            return ExitStatus.STARTUP_ERROR

    return run


def _settings(args: argparse.Namespace) -> Settings:
    """The environment's settings with the flags that were given on top."""
    engine = {f: getattr(args, f, None) for f in EngineSettings.__struct_fields__}
    return Settings.from_env(
        engine=engine,
        database_url=args.database_url,
        engine_mode="redis" if getattr(args, "workers_external", False) else None,
    )


def _open_database(url: str) -> None:
    """Fail fast on a database that cannot be opened; the default embedded database's directory is created."""
    from pagewise.platform.db.session import DatabaseUnreachableError, check_database

    if url == default_database_url():
        ensure_data_dir()
    try:
        asyncio.run(check_database(url))
    except DatabaseUnreachableError as error:
        raise StartupError(str(error)) from None


def _check_port_free(host: str, port: int) -> None:
    """Bind `host:port` exactly as uvicorn will (its address family, SO_REUSEADDR) and let it go: a taken port
    fails before the model loads. Another process may still take it in between; uvicorn then says so."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as error:
        reason = error.strerror or str(error)
        raise StartupError(f"cannot listen on {host}:{port}: {reason} (choose another with --port)") from None


@_exits_2_on_startup_error
def serve_command(args: argparse.Namespace) -> int:
    """Serve until stopped; exit status 3 when the server stopped because its engine died (restart it)."""
    import uvicorn

    from pagewise.platform.app import create_app
    from pagewise.platform.db.session import redacted_url
    from pagewise.platform.engine_loader import engine_problem
    from pagewise.platform.redis_check import check_redis, redis_address
    from pagewise.structured_logs import configure_logging

    settings = _settings(args)
    _check_port_free(args.host, args.port)
    _open_database(settings.database_url)
    print(f"pagewise: database {redacted_url(settings.database_url)}", file=sys.stderr)
    if settings.redis_url is not None:
        asyncio.run(check_redis(settings.redis_url))
        print(f"pagewise: redis {redis_address(settings.redis_url)}", file=sys.stderr)
    if settings.engine_mode == "redis":
        model = settings.engine.listed_model_name
        print(f"pagewise: engine workers over Redis Streams, model {model}", file=sys.stderr)
    elif (problem := engine_problem(settings)) is not None:
        raise StartupError(problem)
    configure_logging(args.log_level)  # JSON lines with trace ids, readable on a terminal; uvicorn's loggers too
    config = uvicorn.Config(
        None, host=args.host, port=args.port, log_level=args.log_level, server_header=False, log_config=None
    )
    server = uvicorn.Server(config)

    def stop() -> None:  # from the engine's thread: uvicorn polls the flag and shuts down gracefully
        server.should_exit = True

    config.app = app = create_app(settings, on_engine_dead=stop)
    server.run()
    services = getattr(app.state, "services", None)
    if services is not None and services.engine.error is not None:
        print(f"error: the engine stopped after an error: {services.engine.error!r}", file=sys.stderr)
        return ExitStatus.ENGINE_DIED
    return ExitStatus.OK


@_exits_2_on_startup_error
def db_upgrade_command(args: argparse.Namespace) -> int:
    from pagewise.platform.db.migrate import upgrade_head
    from pagewise.platform.db.session import redacted_url

    settings = _settings(args)
    _open_database(settings.database_url)
    upgrade_head(settings.database_url)
    print(f"database {redacted_url(settings.database_url)} is at the latest revision")
    return ExitStatus.OK


def in_session(
    command: Callable[[Any, argparse.Namespace], Awaitable[None]],
) -> Callable[[argparse.Namespace], int]:
    """Run an admin command in a session on the configured (migrated) database; API errors exit 1."""

    @_exits_2_on_startup_error
    def run(args: argparse.Namespace) -> int:
        from pagewise.platform.db.migrate import upgrade_head
        from pagewise.platform.db.session import create_db_engine, create_sessionmaker

        settings = _settings(args)
        _open_database(settings.database_url)
        upgrade_head(settings.database_url)

        async def main() -> None:
            engine = create_db_engine(settings.database_url)
            try:
                async with create_sessionmaker(engine)() as session:
                    await command(session, args)
            finally:
                await engine.dispose()

        try:
            asyncio.run(main())
        except APIError as error:
            print(f"error: {error.message}", file=sys.stderr)
            return ExitStatus.FAILED
        return ExitStatus.OK

    return run


def parse_duration(value: str, flag: str) -> dt.timedelta:
    """`0` or a whole number of s, m, h or d (`90m`, `12h`, `30d`); a 400 naming `flag` otherwise."""
    text = value.strip()
    if text == "0":
        return dt.timedelta(0)
    match = _DURATION.fullmatch(text)
    if match is None:
        raise invalid_request(f"{flag} must be a duration such as 90m, 12h or 30d; got {value!r}", param=flag)
    return dt.timedelta(seconds=int(match.group(1)) * _UNIT_S[match.group(2)])


def parse_expiry(value: str, now: dt.datetime) -> dt.datetime:
    """`--expires`: a duration from `now`, or an ISO-8601 date or datetime (naive means UTC)."""
    if _DURATION.fullmatch(value.strip()):
        return now + parse_duration(value, "--expires")
    try:
        return dt.datetime.fromisoformat(value.strip())
    except ValueError:
        raise invalid_request(
            "--expires must be an ISO-8601 date or datetime (2030-01-31, 2030-01-31T12:00:00+02:00)"
            f" or a duration such as 30d, 12h or 90m; got {value!r}",
            param="--expires",
        ) from None


def _quota_values(args: argparse.Namespace) -> dict[str, int | None]:
    given = {f: getattr(args, f) for f in _QUOTA_FLAGS if getattr(args, f) is not None}
    return {f: None if v < 0 else v for f, v in given.items()}


def _tenant_values(args: argparse.Namespace) -> dict[str, float | int | None]:
    """The quotas and weight given on the command line (the service checks them)."""
    return _quota_values(args) | ({"weight": args.weight} if args.weight is not None else {})


def _print_tenant(tenant: Any) -> None:
    quotas = " ".join(f"{f}={getattr(tenant, f)}" for f in _QUOTA_FLAGS)
    print(f"{tenant.id}  {tenant.name}  {tenant.status}  weight={tenant.weight:g}  {quotas}")


async def _tenants_create(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.tenants.schemas import TenantCreate
    from pagewise.platform.tenants.service import TenantService

    _print_tenant(await TenantService(session).create(TenantCreate(name=args.name, **_tenant_values(args))))


async def _tenants_list(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.tenants.service import TenantService

    for tenant in await TenantService(session).list():
        _print_tenant(tenant)


async def _tenants_update(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.tenants.schemas import TenantUpdate
    from pagewise.platform.tenants.service import TenantService

    service = TenantService(session)
    tenant = await service.get_by_name(args.name)
    changes = _tenant_values(args) | ({"status": args.status} if args.status else {})
    _print_tenant(await service.update(tenant.id, TenantUpdate(**changes)))


async def _keys_create(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.db.models import utcnow
    from pagewise.platform.keys.schemas import KeyCreate
    from pagewise.platform.keys.service import KeyService
    from pagewise.platform.tenants.service import TenantService

    expires_at = parse_expiry(args.expires, utcnow()) if args.expires else None
    tenant = await TenantService(session).get_by_name(args.tenant)
    created = await KeyService(session).create(
        tenant.id, KeyCreate(name=args.name, scopes=args.scopes or ["inference"], expires_at=expires_at)
    )
    print(created.key)
    print(
        f"(key {created.id} for tenant {tenant.name}, scopes {','.join(created.scopes)},"
        f" expires {_expiry_text(created.expires_at)}; shown only once)",
        file=sys.stderr,
    )


def _expiry_text(expires_at: dt.datetime | None) -> str:
    from pagewise.platform.db.models import as_utc

    return as_utc(expires_at).isoformat(timespec="seconds") if expires_at else "never"


async def _keys_list(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.keys.service import KeyService, key_out
    from pagewise.platform.tenants.service import TenantService

    tenant_id = (await TenantService(session).get_by_name(args.tenant)).id if args.tenant else None
    for key in map(key_out, await KeyService(session).list(tenant_id)):
        print(
            f"{key.id}  pw_{key.prefix}_…  name={key.name!r}  tenant={key.tenant_id}"
            f"  scopes={','.join(key.scopes)}  {key.status}  expires={_expiry_text(key.expires_at)}"
        )


async def _key_by_id(session: Any, key_id: str) -> Any:
    from pagewise.platform.db.models import ApiKey
    from pagewise.platform.errors import not_found

    key = await session.get(ApiKey, key_id)
    if key is None:
        raise not_found("API key", key_id)
    return key


async def _keys_revoke(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.keys.service import KeyService

    key = await _key_by_id(session, args.key_id)
    await KeyService(session).revoke(key.tenant_id, key.id)
    print(f"revoked {key.id}")


async def _keys_rotate(session: Any, args: argparse.Namespace) -> None:
    from pagewise.platform.keys.service import KeyService

    grace = parse_duration(args.grace_period, "--grace-period")
    key = await _key_by_id(session, args.key_id)
    created = await KeyService(session).rotate(key.tenant_id, key.id, int(grace.total_seconds()))
    print(created.key)
    old = f"works until {_expiry_text(key.expires_at)}" if grace else "is revoked"
    print(f"(key {created.id} replaces {key.id}, which {old}; the new key is shown only once)", file=sys.stderr)
