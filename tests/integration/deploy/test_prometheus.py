"""Prometheus' own checker accepts the scrape config and the alert rules, the rules pass their unit tests, and
every Grafana query is valid PromQL."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from .stack_files import PROMETHEUS_DIR, as_promql, dashboard_expressions

PROMTOOL = shutil.which("promtool")
pytestmark = pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed (apt-get install -y prometheus)")
TOKEN_FILE = "/prometheus/metrics-token"  # written by the prometheus service's entrypoint in docker-compose.yml


def _promtool(*args: str | Path) -> None:
    result = subprocess.run([PROMTOOL, *map(str, args)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_scrape_config_and_its_rule_files_are_valid(tmp_path: Path) -> None:
    """A full check (it opens the token and rule files), on a copy whose token file exists here."""
    shutil.copytree(PROMETHEUS_DIR, tmp_path, dirs_exist_ok=True)
    (tmp_path / "metrics-token").write_text("token")
    config = tmp_path / "prometheus.yml"
    assert TOKEN_FILE in config.read_text()
    config.write_text(config.read_text().replace(TOKEN_FILE, str(tmp_path / "metrics-token")))
    _promtool("check", "config", config)


def test_the_alert_rules_pass_their_unit_tests() -> None:
    _promtool("test", "rules", PROMETHEUS_DIR / "alerts.test.yml")


def test_every_dashboard_query_is_valid_promql(tmp_path: Path) -> None:
    """promtool parses each query as a recording rule's expression (Grafana's `$__…` variables made concrete)."""
    queries = [as_promql(expr) for _, expr in dashboard_expressions()]
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, expr in enumerate(queries)]
    assert rules
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    _promtool("check", "rules", path)
