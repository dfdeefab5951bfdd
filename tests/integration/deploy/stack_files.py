"""The deployment files as data: the compose file as an operator's `.env` makes it, and the PromQL every Grafana
panel and alert rule queries, with the metric names in it."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[3]
COMPOSE_FILE = REPO / "docker-compose.yml"
ENV_EXAMPLE = REPO / "ops" / "pagewise.env.example"
PROMETHEUS_DIR = REPO / "ops" / "prometheus"
DASHBOARDS_DIR = REPO / "ops" / "grafana" / "dashboards"

_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_GRAFANA_VARIABLES = re.compile(r"\$__\w+")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_IDENTIFIER = re.compile(r"(?<![\w.:])[A-Za-z_:][\w:]*(?![\w:])(?!\s*\()")  # not a function or aggregation
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "group_left", "group_right", "inf", "nan"}


def read_env_file(path: Path) -> dict[str, str]:
    """`KEY=VALUE` lines as docker compose reads them; blank lines and `#` comments are skipped."""
    pairs = (line.split("=", 1) for line in path.read_text().splitlines() if line.strip() and not line.startswith("#"))
    return {key.strip(): value.strip() for key, value in pairs}


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution (`${V}`, `${V:-default}`, `${V:?error}`, `$$`) over a parsed file."""
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, operator, argument = match.groups()
        found = env.get(name)
        if found is not None and not (found == "" and operator and operator.startswith(":")):
            return found
        if operator is None:
            return ""
        if operator.endswith("-"):
            return argument
        raise KeyError(f"{name}: {argument}")

    return _VARIABLE.sub(substitute, value)


def compose_stack(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """`docker-compose.yml` with the variables of `env` (default: the example `.env`) substituted."""
    return interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), read_env_file(ENV_EXAMPLE) if env is None else env)


def pagewise_services(stack: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The services that run the pagewise image (api, migrate, workers)."""
    return {name: s for name, s in stack["services"].items() if str(s.get("image", "")).startswith("pagewise:")}


def alert_expressions() -> Iterator[tuple[str, str]]:
    """(alert name, expr) of every rule in `ops/prometheus/alerts.yml`."""
    for group in yaml.safe_load((PROMETHEUS_DIR / "alerts.yml").read_text())["groups"]:
        for rule in group["rules"]:
            yield rule.get("alert") or rule["record"], rule["expr"]


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    """(dashboard / panel title, expr) of every query of every dashboard in `ops/grafana/dashboards`."""
    for path in sorted(DASHBOARDS_DIR.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                yield f"{path.stem} / {panel['title']}", target["expr"]


def as_promql(expr: str) -> str:
    """A Grafana query as plain PromQL: its `$__rate_interval`-style variables become a fixed duration."""
    return _GRAFANA_VARIABLES.sub("5m", expr)


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: label matchers, strings, ranges, grouping labels, functions,
    aggregations, keywords and numbers are not names."""
    text = _STRINGS.sub('""', as_promql(expr))
    for pattern in (_MATCHERS, _RANGES, _GROUPING):
        text = pattern.sub(" ", text)
    return {name for name in _IDENTIFIER.findall(text) if name.lower() not in _KEYWORDS}
