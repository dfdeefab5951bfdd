"""`ops/Dockerfile` has the targets the compose file builds, pins the torch the project pins, and `.dockerignore`
lets through everything the Dockerfile copies. (No Docker daemon here: the image itself is not built.)"""

from __future__ import annotations

import re
import tomllib

from .stack_files import REPO, compose_stack

DOCKERFILE = (REPO / "ops" / "Dockerfile").read_text()


def test_the_compose_file_builds_targets_the_dockerfile_has() -> None:
    targets = set(re.findall(r"^FROM \S+ AS (\S+)$", DOCKERFILE, re.MULTILINE))
    builds = [service["build"] for service in compose_stack()["services"].values() if "build" in service]
    assert {build["dockerfile"] for build in builds} == {"ops/Dockerfile"}
    assert {build["target"] for build in builds} == {"cpu", "cuda"} <= targets


def test_the_image_installs_the_torch_the_project_pins() -> None:
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in dependencies if d.startswith("torch==")]
    assert f"ARG TORCH_VERSION={pin.removeprefix('torch==')}" in DOCKERFILE


def test_the_dockerignore_keeps_what_the_dockerfile_copies() -> None:
    copies = re.findall(r"^COPY (?!--)(.+)$", DOCKERFILE, re.MULTILINE)  # from the build context
    copied = {source for line in copies for source in line.split()[:-1]}
    allowed = {line.removeprefix("!").rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()}
    assert copied == {"pyproject.toml", "README.md", "pagewise"} and copied <= allowed
