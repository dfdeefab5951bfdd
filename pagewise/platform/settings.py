"""Platform settings, read once from `PAGEWISE_*` environment variables and validated with readable errors."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec

from pagewise.platform.paths import data_dir, default_database_url
from pagewise.platform.quotas.quota_store import DEFAULT_LEASE_S

_SUPPORTED_DRIVERS = ("sqlite+aiosqlite", "postgresql+asyncpg")
_POSITIVE_ENGINE_FLAGS = (
    "max_model_len",
    "block_size",
    "max_num_seqs",
    "max_num_batched_tokens",
    "fair_max_num_batched_tokens",
    "interrupt_max_num_batched_tokens",
    "kv_cache_memory_bytes",
)


class SettingsError(ValueError):
    """A setting is missing or malformed; the message names the variable and what is wrong."""


class EngineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Engine flags (vLLM's names). `None` leaves the engine's own default in place."""

    model: str = "smollm2-135m-instruct"
    served_model_name: str | None = None  # comma-separated: the listed name, then aliases
    max_model_len: int | None = None
    block_size: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    fair_max_num_batched_tokens: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float | None = None
    swap_space_bytes: int | None = None
    preemption_mode: str | None = None
    scheduling_policy: str | None = "fair"  # the server shares the engine fairly between tenants by default
    enable_prefix_caching: bool | None = None
    enable_chunked_prefill: bool | None = None
    enable_step_interrupts: bool | None = None
    interrupt_max_num_batched_tokens: int | None = None
    max_interrupts_per_step: int | None = None
    dtype: str | None = None
    gemm_path: str | None = None
    device: str | None = None
    seed: int | None = None
    cache_dir: str | None = None
    enable_lora: bool | None = True  # the server serves tenants' adapters by default (a base-only step pays nothing)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    max_cpu_loras: int | None = None

    @property
    def listed_model_name(self) -> str:
        """The name the model is listed under: the first served name, else the model as given (what the workers
        announce it under, and so the name of its Redis keys)."""
        if self.served_model_name is None:
            return self.model
        return self.served_model_name.split(",", 1)[0].strip()

    def engine_kwargs(self) -> dict[str, Any]:
        """The flags that were set, as keyword arguments for `EngineConfig`."""
        return {f: getattr(self, f) for f in self.__struct_fields__ if getattr(self, f) is not None}


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Everything the service reads from its environment. Built by `Settings.from_env`."""

    database_url: str = msgspec.field(default_factory=default_database_url)  # the per-user embedded database
    redis_url: str | None = None
    redis_key_prefix: str = "pagewise:"
    engine: EngineSettings = msgspec.field(default_factory=EngineSettings)
    max_body_bytes: int = 1_000_000
    quota_lease_s: float = DEFAULT_LEASE_S
    auto_migrate: bool = True
    admin_key: str | None = None
    """`PAGEWISE_ADMIN_KEY`: on an empty database, the bootstrap admin key (`pw_<prefix>_<secret>`) to store."""
    metrics_token: str | None = None
    """`PAGEWISE_METRICS_TOKEN`: a bearer token that may read `/metrics` (admin keys always may)."""
    engine_mode: str = "local"
    """`PAGEWISE_ENGINE_MODE`: `local` runs the engine in this process; `redis` hands requests to
    `pagewise worker` processes over Redis Streams (needs `PAGEWISE_REDIS_URL`; the API then loads no model)."""
    engine_process: bool = True
    """`PAGEWISE_ENGINE_PROCESS`: where this process's engine steps (`pagewise serve` in local mode,
    `pagewise worker`): `true` in a child process of its own, so the model's Python never waits for the web stack's
    GIL (vLLM's engine-core process); `false` in a thread of this process (one process, as a debugger likes it)."""
    max_queue_depth: int = 512
    """`PAGEWISE_MAX_QUEUE_DEPTH` (redis mode): sequences waiting across workers above which new requests get 503."""
    worker_heartbeat_s: float = 1.0
    """`PAGEWISE_WORKER_HEARTBEAT_S`: how often workers report; one silent for 5 heartbeats is dead."""
    max_deliveries: int = 3
    """`PAGEWISE_MAX_DELIVERIES`: deliveries of a request (worker deaths) before it is dead-lettered and failed."""
    routing_affinity: bool = True
    """`PAGEWISE_ROUTING_AFFINITY`: route a tenant's requests to the worker holding its prefix cache."""
    export_dir: str | None = None
    """`PAGEWISE_EXPORT_DIR`: where billing exports are written and served from (default: `<data dir>/exports`)."""
    max_file_bytes: int = 200 * 2**20
    """`PAGEWISE_MAX_FILE_BYTES`: the largest file `POST /v1/files` takes (OpenAI's batch input limit, 200 MiB)."""
    max_adapter_bytes: int = 256 * 2**20
    """`PAGEWISE_MAX_ADAPTER_BYTES`: the largest adapter `POST /v1/adapters` takes (its two files together)."""
    batch_lines_in_flight: int = 64
    """`PAGEWISE_BATCH_LINES_IN_FLIGHT`: a batch's lines handed to the engines at once (a tenant's batches together:
    twice that); they run at the batch priority class, so interactive work goes first."""
    retention_days: int | None = None
    """`PAGEWISE_RETENTION_DAYS`: the retention job drops request input and output finished longer ago than this
    (tokens and cost stay); unset keeps them forever."""
    jobs_visibility_timeout_s: int = 3600
    """`PAGEWISE_JOBS_VISIBILITY_TIMEOUT_S`: a job a worker took but never acknowledged (it died) is handed out
    again after this long; longer than any job's time limit, so a running job is never handed out twice."""

    @property
    def heartbeat_ttl_s(self) -> float:
        """How long a worker stays live without a heartbeat."""
        return 5 * self.worker_heartbeat_s

    @property
    def export_path(self) -> Path:
        """Where billing exports live: `PAGEWISE_EXPORT_DIR`, else `<data dir>/exports`."""
        return Path(self.export_dir) if self.export_dir else data_dir() / "exports"

    @property
    def files_path(self) -> Path:
        """Where uploaded files live: `files/` in the export folder, which every replica and worker mounts."""
        return self.export_path / "files"

    @property
    def adapters_path(self) -> Path:
        """Where tenants' adapters live (`serving/adapter_store.py`): `adapters/` in the export folder, which every
        replica and worker mounts."""
        return self.export_path / "adapters"

    @property
    def is_embedded(self) -> bool:
        """Embedded mode: no Redis, so the engine and the quota counters live in this process."""
        return self.redis_url is None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read `PAGEWISE_*` variables; `overrides` (e.g. CLI flags) win over the environment."""
        env = os.environ if environ is None else environ
        engine_fields = {
            f: _read(env, f"PAGEWISE_{f.upper()}", EngineSettings.__annotations__[f])
            for f in EngineSettings.__struct_fields__
        }
        engine_fields = {k: v for k, v in engine_fields.items() if v is not None}
        engine_fields.update({k: v for k, v in overrides.pop("engine", {}).items() if v is not None})
        fields = {
            f: _read(env, f"PAGEWISE_{f.upper()}", cls.__annotations__[f])
            for f in cls.__struct_fields__
            if f != "engine"
        }
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.update({k: v for k, v in overrides.items() if v is not None})
        settings = cls(engine=EngineSettings(**engine_fields), **fields)
        settings.validate()
        return settings

    def validate(self) -> None:
        """Raise `SettingsError` for values the service cannot start with."""
        driver = self.database_url.split("://", 1)[0]
        if driver not in _SUPPORTED_DRIVERS:
            raise SettingsError(
                f"PAGEWISE_DATABASE_URL uses driver {driver!r}; expected one of"
                f" {', '.join(_SUPPORTED_DRIVERS)}"
                " (e.g. sqlite+aiosqlite:///pagewise.db or postgresql+asyncpg://user@host/db)"
            )
        if self.redis_url is not None and not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise SettingsError(
                f"PAGEWISE_REDIS_URL must start with redis://, rediss:// or unix://; got {self.redis_url!r}"
            )
        if self.engine_mode not in ("local", "redis"):
            raise SettingsError(f"PAGEWISE_ENGINE_MODE must be local or redis; got {self.engine_mode!r}")
        if self.engine_mode == "redis" and self.redis_url is None:
            raise SettingsError("PAGEWISE_ENGINE_MODE=redis (or --workers-external) needs PAGEWISE_REDIS_URL")
        for name in (
            "max_queue_depth",
            "worker_heartbeat_s",
            "max_deliveries",
            "jobs_visibility_timeout_s",
            "max_file_bytes",
            "max_adapter_bytes",
            "batch_lines_in_flight",
        ):
            if getattr(self, name) <= 0:
                raise SettingsError(f"PAGEWISE_{name.upper()} must be positive; got {getattr(self, name)}")
        if self.heartbeat_ttl_s >= self.quota_lease_s:
            raise SettingsError(
                "PAGEWISE_WORKER_HEARTBEAT_S x 5 must be shorter than PAGEWISE_QUOTA_LEASE_S, so a dead worker's "
                "requests are redelivered before their leases expire"
            )
        if self.quota_lease_s <= 0:
            raise SettingsError(f"PAGEWISE_QUOTA_LEASE_S must be positive; got {self.quota_lease_s}")
        if self.retention_days is not None and self.retention_days <= 0:
            raise SettingsError(f"PAGEWISE_RETENTION_DAYS must be positive; got {self.retention_days}")
        if self.max_body_bytes <= 0:
            raise SettingsError(f"PAGEWISE_MAX_BODY_BYTES must be positive; got {self.max_body_bytes}")
        for name in _POSITIVE_ENGINE_FLAGS:
            value = getattr(self.engine, name)
            if value is not None and value <= 0:
                raise SettingsError(f"PAGEWISE_{name.upper()} must be positive; got {value}")


def _read(env: Mapping[str, str], name: str, annotation: str) -> Any:
    """Parse one variable by its field's annotation; unset or empty gives `None`."""
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    raw = raw.strip()
    if "bool" in annotation:
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("0", "false", "no", "off"):
            return False
        raise SettingsError(f"{name} must be true or false; got {raw!r}")
    if "int" in annotation:
        try:
            return int(raw.replace("_", ""))
        except ValueError:
            raise SettingsError(f"{name} must be an integer; got {raw!r}") from None
    if "float" in annotation:
        try:
            return float(raw)
        except ValueError:
            raise SettingsError(f"{name} must be a number; got {raw!r}") from None
    return raw
