"""`docker-compose.yml` is valid for a real compose parser, and everything pagewise in it is real: each command
parses with pagewise's own CLI, each `PAGEWISE_*` variable is a setting with a valid value, and the ports that
Prometheus and the healthchecks use are the ports the commands listen on."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from pagewise.cli import build_parser
from pagewise.platform.keys.key_format import key_from_string
from pagewise.platform.settings import EngineSettings, Settings

from .stack_files import (
    COMPOSE_FILE,
    ENV_EXAMPLE,
    PROMETHEUS_DIR,
    REPO,
    compose_stack,
    pagewise_services,
    read_env_file,
)

DOCKER_COMPOSE = shutil.which("docker-compose")
needs_docker_compose = pytest.mark.skipif(
    DOCKER_COMPOSE is None, reason="docker-compose is not installed (apt-get install -y docker-compose)"
)
SETTINGS_VARIABLES = {f"PAGEWISE_{f.upper()}" for f in (*Settings.__struct_fields__, *EngineSettings.__struct_fields__)}
SETTINGS_VARIABLES.discard("PAGEWISE_ENGINE")  # the struct of engine flags, read as its own variables
OTEL_VARIABLES = {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_TRACES_SAMPLER", "OTEL_SDK_DISABLED"}


def _compose(*args: str) -> subprocess.CompletedProcess[str]:
    """docker-compose with nothing from this shell's environment (no variable leaks into the substitution)."""
    return subprocess.run(
        [DOCKER_COMPOSE, *args], cwd=REPO, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60
    )


@needs_docker_compose
@pytest.mark.parametrize("profiles", [[], ["--profile", "cpu"], ["--profile", "gpu"]], ids=["none", "cpu", "gpu"])
def test_docker_compose_accepts_the_file_with_the_example_env(profiles: list[str]) -> None:
    result = _compose("--env-file", str(ENV_EXAMPLE), *profiles, "-f", str(COMPOSE_FILE), "config", "-q")
    assert result.returncode == 0, result.stderr


@needs_docker_compose
def test_docker_compose_refuses_to_start_without_the_secrets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("")
    result = _compose("--env-file", str(empty), "-f", str(COMPOSE_FILE), "config", "-q")
    assert result.returncode != 0 and "cp ops/pagewise.env.example .env" in result.stderr


def test_the_example_env_sets_every_variable_the_file_requires() -> None:
    stack = compose_stack()  # raises KeyError for a `${VAR:?…}` the example lacks
    key_from_string(stack["services"]["api"]["environment"]["PAGEWISE_ADMIN_KEY"])  # a key the API accepts
    assert re.fullmatch(r"[\w-]+", read_env_file(ENV_EXAMPLE)["POSTGRES_PASSWORD"])  # safe inside the URL


@pytest.mark.parametrize("service", sorted(pagewise_services(compose_stack())))
def test_each_pagewise_command_parses_with_the_pagewise_cli(service: str) -> None:
    command = pagewise_services(compose_stack())[service]["command"]
    assert command[0] == "pagewise"
    build_parser().parse_args(command[1:])  # SystemExit(2) with argparse's message if a flag is wrong


@pytest.mark.parametrize("service", sorted(pagewise_services(compose_stack())))
def test_each_pagewise_variable_is_a_setting_with_a_valid_value(service: str) -> None:
    environment: dict[str, str] = pagewise_services(compose_stack())[service]["environment"]
    ours = {name for name in environment if not name.startswith("OTEL_")}  # OpenTelemetry's own (tracing)
    assert ours <= SETTINGS_VARIABLES, ours - SETTINGS_VARIABLES
    assert set(environment) - ours <= OTEL_VARIABLES, set(environment) - ours - OTEL_VARIABLES
    Settings.from_env(environment)  # SettingsError names a malformed value


def test_only_migrate_migrates_and_everything_else_waits_for_it() -> None:
    services = pagewise_services(compose_stack())
    assert services["migrate"]["command"][1:] == ["db", "upgrade"]
    assert services["api"]["environment"]["PAGEWISE_AUTO_MIGRATE"] == "false"
    for name, service in services.items():
        if name != "migrate":
            assert service["depends_on"]["migrate"] == {"condition": "service_completed_successfully"}, name


def _flag(command: list[str], flag: str) -> str:
    return command[command.index(flag) + 1]


def _scrape_ports() -> dict[str, int]:
    """Prometheus job → the port its DNS service discovery scrapes."""
    jobs = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())["scrape_configs"]
    return {job["job_name"]: job["dns_sd_configs"][0]["port"] for job in jobs if "dns_sd_configs" in job}


def test_prometheus_and_the_healthchecks_use_the_ports_the_commands_listen_on() -> None:
    services = pagewise_services(compose_stack())
    api_port = int(_flag(services["api"]["command"], "--port"))
    worker_ports = {int(_flag(services[n]["command"], "--metrics-port")) for n in ("worker-cpu", "worker-gpu")}
    assert len(worker_ports) == 1
    assert _scrape_ports() == {"pagewise-api": api_port, "pagewise-worker": next(iter(worker_ports))}
    assert f"127.0.0.1:{api_port}/health" in " ".join(services["api"]["healthcheck"]["test"])
    for name in ("worker-cpu", "worker-gpu"):
        assert f"127.0.0.1:{next(iter(worker_ports))}/metrics" in " ".join(services[name]["healthcheck"]["test"])


def test_prometheus_reads_the_metrics_token_from_the_file_its_entrypoint_writes() -> None:
    prometheus: dict[str, Any] = compose_stack()["services"]["prometheus"]
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    files = {job["authorization"]["credentials_file"] for job in config["scrape_configs"] if "authorization" in job}
    assert len(files) == 1 and f"> {files.pop()}" in prometheus["command"][0]
    assert "PAGEWISE_METRICS_TOKEN" in prometheus["environment"]


def test_the_gpu_worker_reserves_a_gpu_and_runs_on_it() -> None:
    worker = compose_stack()["services"]["worker-gpu"]
    assert worker["deploy"]["resources"]["reservations"]["devices"][0]["driver"] == "nvidia"
    assert _flag(worker["command"], "--device") == "cuda"
    assert worker["build"]["target"] == "cuda" and compose_stack()["services"]["worker-cpu"]["build"]["target"] == "cpu"
