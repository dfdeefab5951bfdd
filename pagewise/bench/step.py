"""``pagewise bench step``: where one decode step's time goes, for each CPU attention backend side by side.

On the real model (fp32), a batch of ``--num-seqs`` sequences decodes one token each at a context of C tokens,
for each C of ``--contexts``. Every sequence owns distinct KV blocks (filled with random keys and values), taken
through the engine's KV cache manager one sequence after another, so they lie in runs as the engine places a
request's blocks (``BlockPool``), and the step runs through the engine's own ``ModelRunner.execute``:
input tensors built from the requests, the forward pass over the paged cache, logits, sampling. Each step is
timed whole and split by wrapping the parts:

- ``matmul_ms``: every ``nn.Linear`` (QKV, output, gate/up, down projections, and the LM head), on the matmul
  path ``--gemm-path`` names (default: the engine's own choice);
- ``attention_ms``: ``kernels.paged_attention`` and ``kernels.reshape_and_cache`` in all layers;
- ``sampling_ms``: the sampler (greedy rows, or ``--sampled``: temperature 0.8, top-p 0.95, top-k 50);
- ``other_ms``: the rest — RoPE, RMSNorm, residual adds, embedding, and the Python that builds the inputs.

Backends: ``cpu`` (the compiled kernels, when built) and ``torch`` (the reference), alternated step by step so
machine noise hits both alike; each figure is the median over ``--steps`` steps after one warm-up step. The
scheduler is not part of a step here (it is measured by the engine's own benches).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections.abc import Iterator
from typing import Any

from pagewise.bench._common import add_model_arg, print_table, progress
from pagewise.exit_status import ExitStatus

PARTS = ("matmul_ms", "attention_ms", "sampling_ms", "other_ms")
_NOT_THE_LIMIT_BYTES = 1 << 40


class StepClock:
    """Accumulates the time spent inside wrapped callables, per part, during one step."""

    def __init__(self) -> None:
        self.spent = dict.fromkeys(PARTS[:-1], 0.0)

    def wrap(self, part: str, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start

        return timed


@contextlib.contextmanager
def instrumented(runner, clock: StepClock) -> Iterator[None]:
    """Time ``runner``'s linear layers, paged-KV ops and sampler into ``clock`` (undone on exit)."""
    import torch

    from pagewise import kernels

    patched: list[tuple[Any, str, Any]] = []

    def patch(owner, name: str, part: str) -> None:
        original = getattr(owner, name)
        patched.append((owner, name, original))
        setattr(owner, name, clock.wrap(part, original))

    for module in runner.model.modules():
        if isinstance(module, torch.nn.Linear):
            patch(module, "forward", "matmul_ms")
    patch(kernels, "paged_attention", "attention_ms")
    patch(kernels, "reshape_and_cache", "attention_ms")
    patch(runner, "sampler", "sampling_ms")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            if isinstance(owner, torch.nn.Module):
                delattr(owner, name)  # back to the class's forward
            else:
                setattr(owner, name, original)


def decode_batch(engine, num_seqs: int, context: int, sampled: bool, seed: int):
    """A ``SchedulerOutput`` of ``num_seqs`` requests decoding at ``context``, on distinct blocks of the engine's
    pool (``release_batch`` gives them back)."""
    import random

    from pagewise.engine.request import Request, RequestStatus
    from pagewise.engine.sampling_params import SamplingParams
    from pagewise.engine.scheduler import SchedulerOutput

    rng = random.Random(seed)
    params = (
        SamplingParams(temperature=0.8, top_p=0.95, top_k=50, max_tokens=16, ignore_eos=True)
        if sampled
        else SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    out = SchedulerOutput()
    for s in range(num_seqs):
        request = Request(f"step-{s}", [rng.randrange(3, engine.arch.vocab_size) for _ in range(context)], params, s)
        if not engine.kv.allocate_slots(request, context):
            raise RuntimeError(f"the KV cache holds fewer than {num_seqs} sequences of {context} tokens")
        request.num_computed_tokens = context - 1
        request.status = RequestStatus.RUNNING
        out.scheduled[request] = 1
    return out


def release_batch(engine, batch) -> None:
    """Give ``decode_batch``'s blocks back to the engine's pool."""
    for request in batch.scheduled:
        engine.kv.free(request)


def measure(engine, batch, backends: list[str], steps: int) -> dict[str, dict[str, float]]:
    """Median step figures per backend, the backends alternated step by step."""
    samples: dict[str, list[dict[str, float]]] = {b: [] for b in backends}
    previous = os.environ.get("PAGEWISE_KERNEL_BACKEND")
    try:
        for step in range(steps + 1):
            for backend in backends:
                os.environ["PAGEWISE_KERNEL_BACKEND"] = backend
                clock = StepClock()
                with instrumented(engine.runner, clock):
                    start = time.perf_counter()
                    engine.runner.execute(batch)
                    total = time.perf_counter() - start
                if step == 0:
                    continue  # warm-up
                figures = {part: seconds * 1e3 for part, seconds in clock.spent.items()}
                figures["other_ms"] = total * 1e3 - sum(figures.values())
                figures["total_ms"] = total * 1e3
                samples[backend].append(figures)
    finally:
        if previous is None:
            os.environ.pop("PAGEWISE_KERNEL_BACKEND", None)
        else:
            os.environ["PAGEWISE_KERNEL_BACKEND"] = previous
    return {
        backend: {key: statistics.median(s[key] for s in runs) for key in (*PARTS, "total_ms")}
        for backend, runs in samples.items()
    }


def run(args: argparse.Namespace) -> int:
    import torch

    from pagewise.engine.config import EngineConfig
    from pagewise.engine.llm_engine import LLMEngine
    from pagewise.kernels import cpu_ops

    contexts = [64, 256] if args.quick else args.contexts
    num_seqs = 8 if args.quick else args.num_seqs
    steps = 2 if args.quick else args.steps
    longest = max(contexts)
    progress(f"loading {args.model} ...")
    # The engine allocates no more blocks than `max_num_seqs` sequences at `max_model_len` can use — exactly this
    # batch at its longest context — so the budget only has to be large enough not to be the limit.
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_model_len=max(longest + 16, 256),
            max_num_seqs=num_seqs,
            kv_cache_memory_bytes=_NOT_THE_LIMIT_BYTES,
            gemm_path=args.gemm_path,
            dtype=args.dtype,
        ),
        progress=False,
    )
    for key_cache, value_cache in engine.runner.kv_cache.layers:
        key_cache.normal_()
        value_cache.normal_()
    backends = (["cpu"] if cpu_ops.available() else []) + ["torch"]
    result: dict[str, Any] = {
        "num_seqs": num_seqs,
        "gemm_path": engine.gemm.plan.describe(),
        "precision": engine.precision.describe(),
        "sampled": args.sampled,
        "torch_threads": torch.get_num_threads(),
        "backends": backends,
        "contexts": {},
    }
    for context in contexts:
        progress(f"context {context}: {steps} steps x {len(backends)} backends ...")
        batch = decode_batch(engine, num_seqs, context, args.sampled, seed=context)
        figures = measure(engine, batch, backends, steps)
        release_batch(engine, batch)
        if "cpu" in figures:
            figures["speedup_cpu_vs_torch"] = figures["torch"]["total_ms"] / figures["cpu"]["total_ms"]
        result["contexts"][str(context)] = figures
    if args.json:
        print(json.dumps(result))
    else:
        rows: list[tuple[str, object]] = []
        for context, figures in result["contexts"].items():
            for backend in backends:
                rows += [(f"ctx {context} {backend} {part}", figures[backend][part]) for part in (*PARTS, "total_ms")]
            if "speedup_cpu_vs_torch" in figures:
                rows.append((f"ctx {context} speedup cpu vs torch", figures["speedup_cpu_vs_torch"]))
        print_table(rows)
    return ExitStatus.OK


def register(subparsers) -> None:
    parser = subparsers.add_parser("step", help="one decode step's time by part, compiled vs reference attention")
    add_model_arg(parser)
    parser.add_argument("--num-seqs", type=int, default=64, help="sequences in the decode batch (default 64)")
    parser.add_argument(
        "--contexts", type=int, nargs="+", default=[128, 512, 1024], help="context lengths (default 128 512 1024)"
    )
    parser.add_argument("--steps", type=int, default=5, help="measured steps per backend and context (default 5)")
    parser.add_argument("--sampled", action="store_true", help="sample (T 0.8, top-p 0.95, top-k 50), not greedy")
    parser.add_argument("--gemm-path", default="auto", help="the engine's matmul path (default: auto)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"], help="default: auto")
    parser.set_defaults(func=run)


__all__ = ["decode_batch", "measure", "register", "release_batch", "run"]
