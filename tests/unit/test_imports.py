"""An API process loads no model code: importing the platform, the protocol, the Redis transport or the command
line of an API replica (`pagewise serve --workers-external`) must not import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    "module",
    [
        "pagewise",
        "pagewise.platform",
        "pagewise.platform.app",
        "pagewise.serving.protocol",
        "pagewise.serving.host",
        "pagewise.worker.redis_worker",
        "pagewise.platform.transports.redis",
        "pagewise.jobs",
        "pagewise.jobs.tasks",
    ],
)
def test_importing_does_not_load_torch(module: str) -> None:
    probe = f"import sys, {module}; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_the_command_line_without_benchmarks_does_not_load_torch() -> None:
    probe = (
        "import sys; from pagewise.cli import build_parser; "
        "build_parser(with_bench=False).parse_args(['serve', '--workers-external']); print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", done.stderr


def test_the_engine_names_still_come_from_pagewise() -> None:
    import pagewise

    assert pagewise.LLM.__name__ == "LLM" and pagewise.SamplingParams.__name__ == "SamplingParams"
    with pytest.raises(AttributeError):
        _ = pagewise.NoSuchName
