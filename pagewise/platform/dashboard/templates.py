"""The dashboard's Jinja environment: templates in `templates/`, autoescaped, and an undefined name is an error
(a typo in a template fails its test instead of rendering blank)."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from litestar.plugins.jinja import JinjaTemplateEngine
from litestar.template.config import TemplateConfig

from pagewise.serving.money import format_dollars

TEMPLATE_DIR = Path(__file__).parent / "templates"
NOTHING = "—"


def when(moment: dt.datetime | float | None) -> str:
    """A moment (datetime or unix seconds) in UTC to the second; naive datetimes are UTC already."""
    if moment is None:
        return NOTHING
    if isinstance(moment, int | float):
        moment = dt.datetime.fromtimestamp(moment, dt.UTC)
    elif moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def number(value: int | float | None) -> str:
    if value is None:
        return NOTHING
    return f"{value:,}" if isinstance(value, int) else f"{value:,.2f}"


def percent(value: float) -> str:
    return f"{value:.1%}"


def seconds_between(start: dt.datetime | None, end: dt.datetime | None) -> str:
    if start is None or end is None:
        return NOTHING
    return f"{(end - start).total_seconds() * 1000:,.0f} ms"


def size(value: int) -> str:
    """A byte count in the largest binary unit (up to GiB) that keeps it at least 1."""
    if value < 1024:
        return f"{value:,} B"
    scaled = float(value)
    for unit in ("KiB", "MiB", "GiB"):
        scaled /= 1024
        if scaled < 1024 or unit == "GiB":
            break
    return f"{scaled:,.1f} {unit}"


def limit(value: int | None) -> str:
    """A quota: `None` is no limit."""
    return "no limit" if value is None else f"{value:,}"


def environment() -> Environment:
    env = Environment(loader=FileSystemLoader(TEMPLATE_DIR), autoescape=True, undefined=StrictUndefined)
    env.filters.update(when=when, number=number, percent=percent, limit=limit, size=size, dollars=format_dollars)
    env.globals["seconds_between"] = seconds_between
    return env


def template_config() -> TemplateConfig:
    return TemplateConfig(instance=JinjaTemplateEngine.from_environment(environment()))
