"""The README's commands, run as written: its code blocks and inline commands are extracted and executed against a
fresh embedded server (`pagewise serve` on SQLite), the distributed section's against PostgreSQL, so the README
cannot drift from the product again.

Only what a reader cannot type literally is substituted: the server's port for `localhost:8000`, the admin key
for `pw_...` in `export ADMIN=pw_...`, and each placeholder (`<id>`, the tenant key `pw_...`, `MODEL`) by the value
the command before it printed. `PAGEWISE_TEST_README` points the walk at another copy (to see it fail on a broken
one).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagewise.bench.local_server import LocalServer, local_server
from pagewise.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
README = Path(os.environ.get("PAGEWISE_TEST_README", ROOT / "README.md"))
MODEL = "smollm2-135m-instruct"
BIN = Path(sys.executable).parent  # `.venv/bin`: what `. .venv/bin/activate` puts on PATH


def blocks(language: str) -> list[str]:
    """The README's fenced code blocks in `language`, in order."""
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.DOTALL)


def block_with(language: str, needle: str) -> str:
    found = [b for b in blocks(language) if needle in b]
    assert found, f"no {language} block of {README} contains {needle!r}"
    return found[0]


def inline(pattern: str) -> str:
    """The first inline command (`` `…` ``) of the README matching `pattern`."""
    for command in re.findall(r"`([^`\n]+)`", README.read_text()):
        if re.match(pattern, command):
            return command
    raise AssertionError(f"no inline command of {README} matches {pattern!r}")


def shell(command: str, env: dict[str, str], cwd: Path = ROOT) -> str:
    """`command` in bash with `.venv/bin` first on PATH; its stdout, after checking it succeeded."""
    environment = {**env, "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}"}
    run = subprocess.run(["bash", "-c", command], cwd=cwd, env=environment, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"`{command}` failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    return run.stdout


def clean_env(data_home: Path) -> dict[str, str]:
    """This process's environment without `PAGEWISE_*`, with its own per-user data directory."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("PAGEWISE_")}
    return base | {"XDG_DATA_HOME": str(data_home)}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    workdir = tmp_path_factory.mktemp("readme")
    database_url = f"sqlite+aiosqlite:///{workdir / 'readme.db'}"
    env = {"XDG_DATA_HOME": str(workdir / "data")}
    with local_server(workdir, database_url, ["--max-model-len", "512"], env=env) as running:
        yield running


def test_the_activation_line_puts_the_commands_on_path() -> None:
    line = next(line for line in block_with("bash", "make test").splitlines() if "activate" in line)
    command = line.split("#")[0].strip()
    if not (ROOT / ".venv" / "bin" / "activate").exists():
        pytest.skip("no .venv at the repository root (the tests run from another environment)")
    found = shell(f"{command} && command -v pagewise && python -c 'import msgspec, pagewise'", dict(os.environ))
    assert found.strip().endswith(str(ROOT / ".venv" / "bin" / "pagewise"))


def test_the_first_start_block_runs_as_written(server: LocalServer, tmp_path: Path) -> None:
    """Create a tenant, a key, and chat with it — the block's three curls, in order, each answer used by the next."""
    env = clean_env(tmp_path)
    lines = [line.split("  #")[0].strip() for line in block_with("bash", "/admin/tenants").splitlines()]
    commands = _joined(lines)
    port = server.base.rsplit(":", 1)[1]
    answers: list[dict[str, Any]] = []
    for command in commands:
        command = command.replace("localhost:8000", f"127.0.0.1:{port}")
        if command.startswith("export ADMIN="):
            env["ADMIN"] = server.admin_key
            continue
        if "<id>" in command:
            command = command.replace("<id>", answers[-1]["id"])
        if "Bearer pw_..." in command:
            command = command.replace("Bearer pw_...", f"Bearer {answers[-1]['key']}")
        answer = json.loads(shell(command, env))
        assert "error" not in answer, (command, answer)
        answers.append(answer)
    assert answers[0]["name"] == "acme" and answers[1]["key"].startswith("pw_")
    chat = answers[2]
    assert chat["id"].startswith("chatcmpl-") and chat["choices"][0]["message"]["content"]
    assert chat["usage"]["completion_tokens"] <= 32


def _joined(lines: list[str]) -> list[str]:
    """Shell lines with their `\\` continuations joined, blank lines dropped."""
    commands: list[str] = []
    pending = ""
    for line in lines:
        pending = f"{pending} {line}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1]
            continue
        if pending:
            commands.append(pending)
        pending = ""
    return commands


def test_the_key_one_liner_and_the_cli_alternative(tmp_path: Path) -> None:
    """`python -c …` makes a key in the admin-key format; `pagewise tenants create` and `keys create` work on a
    fresh per-user database, as the README's inline commands are written."""
    env = clean_env(tmp_path / "data")
    one_liner = inline(r"python -c ")
    key = shell(one_liner, env).strip()
    assert re.fullmatch(r"pw_[0-9a-f]{12}_\S+", key)
    created = shell(inline(r"pagewise tenants create "), env)
    assert "acme" in created
    made = shell(inline(r"pagewise keys create "), env)
    assert "pw_" in made


def test_the_offline_python_block_runs() -> None:
    code = block_with("python", "from pagewise import LLM")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip()


def test_the_distributed_commands_parse_and_the_upgrade_runs(fresh_database) -> None:  # noqa: ANN001
    """`pagewise db upgrade` migrates a fresh PostgreSQL database; the worker and replica lines are valid
    command lines of today's CLI (every flag known, every value of its type)."""
    commands = _joined(block_with("bash", "pagewise worker").splitlines())
    exported = next(c for c in commands if c.startswith("export PAGEWISE_DATABASE_URL="))
    assignments = dict(word.split("=", 1) for word in shlex.split(exported)[1:])
    assert assignments["PAGEWISE_DATABASE_URL"].startswith("postgresql+asyncpg://")
    assert assignments["PAGEWISE_REDIS_URL"].startswith("redis://")
    env = clean_env(Path("/nonexistent")) | {"PAGEWISE_DATABASE_URL": fresh_database("postgres")}
    parser = build_parser()
    for command in commands:
        words = [w for w in shlex.split(command.split("  #")[0], comments=True) if not re.match(r"^[A-Z_]+=", w)]
        if not words or words[0] != "pagewise":
            continue
        if words[1:3] == ["db", "upgrade"]:
            shell(shlex.join(words), env)
        else:
            parser.parse_args(words[1:])  # exits (a failed test) on an unknown flag or a bad value


def test_the_billing_commands_work_as_written(server: LocalServer, tmp_path: Path) -> None:
    """The CLI's price line, the same price over HTTP with the body the README shows, and usage grouped by key."""
    env = clean_env(tmp_path) | {"PAGEWISE_DATABASE_URL": _database_of(server)}
    cli = inline(r"pagewise prices set MODEL ").replace("MODEL", MODEL)
    assert "0.15" in shell(cli, env)
    body = re.search(r"`POST /admin/prices` with `(\{.*?\})`", README.read_text(), flags=re.DOTALL)
    assert body, "the README shows no POST /admin/prices body"
    price = json.loads(body.group(1).replace("\n", " "))
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    posted = httpx.post(f"{server.base}/admin/prices", json=price, headers=admin, timeout=30)
    assert posted.status_code == 201, posted.text
    listed = httpx.get(f"{server.base}/admin/prices", params={"model": MODEL}, headers=admin, timeout=30).json()
    prices = [{k: version[k] for k in ("input", "cached_input", "output")} for version in listed]
    assert len(prices) == 2 and prices[0] == prices[1]  # the CLI's line and the API's body: one price
    grouping = re.search(r"\?group_by=(\w+)", README.read_text())
    assert grouping, "the README names no usage grouping"
    usage = httpx.get(f"{server.base}/admin/usage?group_by={grouping.group(1)}", headers=admin, timeout=30)
    assert usage.status_code == 200, usage.text


def _database_of(server: LocalServer) -> str:
    return f"sqlite+aiosqlite:///{server.log_path.parent / 'readme.db'}"


def _compose_lines() -> tuple[list[str], list[str]]:
    """The words of the compose block's `cp` line and of its `docker-compose` line."""
    commands = _joined(block_with("bash", "docker-compose").splitlines())
    copy, compose = (next(c for c in commands if c.startswith(start)) for start in ("cp ", "docker-compose"))
    return shlex.split(copy, comments=True), shlex.split(compose, comments=True)


def test_the_compose_lines_name_real_files_and_profiles() -> None:
    copy, profile = _compose_lines()
    assert (ROOT / copy[1]).is_file()
    named = profile[profile.index("--profile") + 1]
    compose = (ROOT / "docker-compose.yml").read_text()
    assert re.search(rf"profiles:\s*\[?[^\n]*\b{named}\b", compose), f"no service has profile {named}"


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_the_compose_lines_give_a_valid_stack(tmp_path: Path) -> None:
    """The block's `cp` then its `docker-compose` line, with `config` for `up -d` (no Docker daemon needed): the
    env file the README copies makes a stack that a real compose parser accepts. The copy goes to a scratch
    directory, passed by `--env-file`, so the checkout gets no `.env`."""
    copy, words = _compose_lines()
    shutil.copyfile(ROOT / copy[1], tmp_path / ".env")
    assert words[-2:] == ["up", "-d"], words
    run = subprocess.run([*words[:1], "--env-file", str(tmp_path / ".env"), *words[1:-2], "config", "--quiet"],
                         cwd=ROOT, env={"PATH": os.environ["PATH"]}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr


def test_the_openapi_documents_are_where_the_readme_says(server: LocalServer) -> None:
    named = dict(re.findall(r"(JSON|YAML) at `(/schema[^`]*)`", README.read_text()))
    assert named.keys() == {"JSON", "YAML"}, named
    as_json = httpx.get(f"{server.base}{named['JSON']}", timeout=30)
    assert as_json.status_code == 200 and as_json.json()["openapi"].startswith("3.")
    as_yaml = httpx.get(f"{server.base}{named['YAML']}", timeout=30)
    assert as_yaml.status_code == 200 and "\nopenapi: 3." in f"\n{as_yaml.text}"


def test_generate_takes_one_prompt_per_argument_as_the_readme_says(tiny_model, tmp_path: Path) -> None:
    """The README's two examples, each run: the quoted prompt is one, the unquoted words two."""
    path, _ = tiny_model("readme-generate")
    examples = re.findall(r"\(`(pagewise generate [^`]+)` is one prompt,\s+`(pagewise generate [^`]+)` two\)",
                          README.read_text())
    assert examples, "the README no longer says how generate splits its prompts"
    for command, prompts in zip(examples[0], (1, 2), strict=True):
        flags = f"--model {shlex.quote(str(path))} --max-tokens 2"
        out = shell(command.replace("pagewise generate", f"pagewise generate {flags}", 1), clean_env(tmp_path))
        assert len([line for line in out.splitlines() if line.startswith("### ")]) == prompts, (command, out)
