"""``pagewise serve`` in a child process on a free port: what benchmarks and end-to-end tests drive.

The child gets a fresh admin key through ``PAGEWISE_ADMIN_KEY`` (its first start on an empty database stores it),
its output goes to a log file that every error quotes, and it is ready once ``/ready`` answers 200.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 300


def stop_process_group(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM to the session `process` leads (started with ``start_new_session=True``) — to the whole group, even
    when the leader has exited already — and SIGKILL after `timeout` seconds; returns once `process` has exited."""
    try:
        os.killpg(process.pid, signal.SIGTERM)  # the group: what the leader started may outlive it
    except ProcessLookupError:  # nothing of the group is left
        process.wait()
        return
    try:
        process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@dataclass(frozen=True, slots=True)
class LocalServer:
    base: str
    admin_key: str
    process: subprocess.Popen
    log_path: Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def local_server(
    workdir: Path,
    database_url: str,
    serve_args: Sequence[str] = (),
    *,
    env: Mapping[str, str] | None = None,
    command: Sequence[str] | None = None,
) -> Iterator[LocalServer]:
    """Start the server (``command`` + ``--port P`` + ``serve_args``; default ``python -m pagewise.cli serve``) on
    ``database_url`` and yield it once ready; stop it afterwards. ``env`` adds variables (``PAGEWISE_REDIS_URL`` is
    dropped unless given there)."""
    from pagewise.platform.keys.key_format import generate_key

    admin_key, port = generate_key().key, free_port()
    environment = {**os.environ, "PAGEWISE_DATABASE_URL": database_url, "PAGEWISE_ADMIN_KEY": admin_key}
    environment.pop("PAGEWISE_REDIS_URL", None)
    environment.update(env or {})
    argv = [*(command or (sys.executable, "-m", "pagewise.cli", "serve")), "--port", str(port), *serve_args]
    log_path = workdir / "server.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=environment)
    server = LocalServer(f"http://127.0.0.1:{port}", admin_key, process, log_path)
    try:
        wait_ready(server)
        yield server
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def wait_ready(server: LocalServer) -> None:
    """Poll ``/ready`` until it answers 200; `RuntimeError` (with the server's output) if it exits or times out."""
    wait_answering(server.process, f"{server.base}/ready", START_TIMEOUT_S, server.log_path, "the server")


LOG_TAIL_CHARS = 8_000  # of a server's log, quoted in the error when it does not come up


def wait_answering(process: subprocess.Popen, url: str, timeout_s: float, log_path: Path, what: str) -> None:
    """Poll `url` until it answers 200; `RuntimeError` naming `what`, with the end of its log, if `process` exits
    first or `timeout_s` passes."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}:\n{_log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not answer within {timeout_s:.0f} s:\n{_log_tail(log_path)}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.25)


def _log_tail(path: Path) -> str:
    text = path.read_text(errors="replace")
    return text if len(text) <= LOG_TAIL_CHARS else f"… (whole log: {path})\n{text[-LOG_TAIL_CHARS:]}"
