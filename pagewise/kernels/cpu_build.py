"""Builds the compiled CPU kernels (``csrc/paged_attention_cpu.cpp``) with the machine's C++ compiler.

``python -m pagewise.kernels.cpu_build`` (run by ``make install`` and the Dockerfile) compiles the source once into
``PAGEWISE_KERNEL_DIR`` (default: ``cpu_kernels`` in ``PAGEWISE_CACHE_DIR``, itself ``~/.cache/pagewise`` by
default), under a name keyed by the source, the torch version and the flags: a changed source or a new torch
builds a new library, and a stale one is never loaded. The build is atomic (a temporary file renamed into place).
One build serves every x86 machine: its hot loops are compiled for AVX-512, AVX2 and baseline, and the best one
the CPU supports is picked at run time.

Without a compiler the command prints why and exits 0: the engine then runs the torch reference (``cpu_ops``
warns once), so an install never fails for want of a compiler.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "paged_attention_cpu.cpp"
_FLAGS = ("-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp", "-ffast-math", "-Wall")


def _torch_lib_dir() -> Path:
    return Path(torch.__file__).parent / "lib"


def _command(output: Path, compiler: str) -> list[str]:
    from torch.utils.cpp_extension import include_paths

    lib = _torch_lib_dir()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *_FLAGS,
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{path}" for path in include_paths()),
        str(SOURCE),
        "-o",
        str(output),
        f"-L{lib}",
        "-lc10",
        "-ltorch_cpu",
        "-lgomp",  # resolves to torch's own libgomp.so.1 (rpath), so one OpenMP runtime is loaded
        f"-Wl,-rpath,{lib}",
    ]


def library_path() -> Path:
    """Where the library for this source, torch and flag set lives (whether or not it is built)."""
    key = hashlib.sha256(SOURCE.read_bytes() + f"|{torch.__version__}|{_FLAGS}".encode()).hexdigest()[:16]
    name = f"paged_attention_cpu-{key}.so"
    if directory := os.environ.get("PAGEWISE_KERNEL_DIR"):
        return Path(directory).expanduser() / name
    cache = os.environ.get("PAGEWISE_CACHE_DIR")
    root = Path(cache).expanduser() if cache else Path.home() / ".cache" / "pagewise"
    return root / "cpu_kernels" / name


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build(*, force: bool = False) -> Path:
    """Compile the library unless it is already built; returns its path. Raises ``RuntimeError`` with the
    compiler's message if there is no compiler or the build fails."""
    target = library_path()
    if target.exists() and not force:
        return target
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / target.name
        result = subprocess.run(_command(partial, cxx), capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"{cxx} failed:\n{result.stderr.strip()}")
        partial.replace(target)
    return target


def main() -> int:
    if library_path().exists() and "--force" not in sys.argv[1:]:
        return 0
    print(f"pagewise: building the CPU kernels from {SOURCE.name} ...", file=sys.stderr)
    try:
        path = build(force="--force" in sys.argv[1:])
    except RuntimeError as error:
        print(f"pagewise: CPU kernels not built, the torch reference will run instead: {error}", file=sys.stderr)
        return 0
    print(f"pagewise: CPU kernels at {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
