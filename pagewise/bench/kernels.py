"""``pagewise bench kernels [--json]``: correctness and speed of the Triton KV-cache kernels on a CUDA GPU.

Sections, in order (each one's failure is recorded and the rest still run):

1. correctness: every Triton kernel against the torch reference in bf16 (attention relative error
   <= 1e-2, cache writes/copies exact) on a few small shapes, including a long split-context decode;
2. device-to-device copy bandwidth (``(read + write) bytes / time`` of a 1 GiB ``copy_``);
3. decode attention, batch 64 x context 4,096 and batch 8 x context 32,768 (32 query heads, 8 KV heads,
   head dim 128, block size 16, bf16, blocks in random order): median time (``triton.testing.do_bench``),
   effective bandwidth (K/V bytes read / time) as a fraction of the copy bandwidth, and the time of
   ``scaled_dot_product_attention`` on the same K/V laid out contiguously; plus a sweep of split counts;
4. a chunked-prefill step: 2,048 new tokens over 8 sequences of 4,096 context each;
5. ``reshape_and_cache`` and ``copy_blocks`` bandwidth;
6. end-to-end engine throughput with a random-weight ~1.1B-parameter Llama-shaped model in bf16.

Targets (issue 4): decode attention >= 80% of copy bandwidth and <= 1.15x the contiguous SDPA time.
Designed to stay well under 8 minutes of GPU time.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pagewise.exit_status import ExitStatus

DECODE_CONFIGS = ((64, 4096), (8, 32768))  # (batch, context)
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
BANDWIDTH_TARGET, SDPA_TARGET = 0.80, 1.15
ATTN_TOL = 1e-2


def register(subparsers: Any) -> None:
    """Add the ``kernels`` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser("kernels", help="GPU benchmark of the Triton kernels (needs CUDA)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--skip-engine", action="store_true", help="skip the end-to-end engine section")
    parser.set_defaults(func=run)


# ----------------------------------------------------------------------------------------------- helpers


def _rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.double() - expected.double()).abs().max()
    return float(diff / expected.double().abs().max().clamp_min(1e-30))


def _bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (``triton.testing.do_bench``, which flushes L2 between runs)."""
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=200, return_mode="median"))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _paged_inputs(
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> dict[str, Any]:
    """Random caches with each sequence's blocks in random order; block tables padded with spare ids."""
    gen = torch.Generator(device=device).manual_seed(seed)
    needed = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(needed)
    num_blocks = sum(needed) + 8
    perm = torch.randperm(num_blocks, device=device, generator=gen).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=device)
    start = 0
    for s, n in enumerate(needed):
        tables[s, :n] = perm[start : start + n]
        tables[s, n:] = perm[-1]  # padding: a spare block
        start += n
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    value_cache = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    query = torch.randn(qsl[-1], num_heads, head_dim, dtype=dtype, device=device, generator=gen)
    return {
        "query": query,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(qsl, dtype=torch.int32, device=device),
        "scale": head_dim**-0.5,
    }


def _attention_args(inputs: dict[str, Any]) -> tuple:
    keys = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc", "scale")
    return tuple(inputs[k] for k in keys)


# ------------------------------------------------------------------------------------------- sections

CORRECTNESS_CASES = (
    # name, seq_lens, q_lens, heads, kv_heads, head_dim, block_size, dtype
    ("decode_gqa4_d128_b16", [1, 15, 17, 300, 1000], [1] * 5, 32, 8, 128, 16, torch.bfloat16),
    ("long_decode_splits_d128_b16", [20000, 7777], [1, 1], 32, 8, 128, 16, torch.bfloat16),
    ("mixed_gqa3_d80_b8", [1, 9, 300, 130, 64], [1, 9, 40, 1, 64], 12, 4, 80, 8, torch.bfloat16),
    ("prefix_gqa8_d96_b32", [700, 33], [200, 1], 16, 2, 96, 32, torch.bfloat16),
    ("prefill_mha_d64_b16", [512, 100], [512, 100], 8, 8, 64, 16, torch.bfloat16),
    ("mixed_gqa4_d128_b16_fp16", [1, 1200, 257], [1, 300, 1], 32, 8, 128, 16, torch.float16),
)


def check_correctness(device: torch.device, cases: tuple = CORRECTNESS_CASES) -> list[dict[str, Any]]:
    """Every Triton kernel against the torch reference; one record per check."""
    from pagewise.kernels import reference, triton_ops
    from pagewise.kernels.triton_attention import paged_attention as triton_attention

    records = []
    for name, seq_lens, q_lens, heads, kv_heads, dim, block, dtype in cases:
        inputs = _paged_inputs(seq_lens, q_lens, heads, kv_heads, dim, block, dtype, device, seed=len(name))
        args = _attention_args(inputs)
        expected = reference.paged_attention(*args)
        for splits in (None, 4):
            out = torch.full_like(inputs["query"], float("nan"))
            triton_attention(*args, num_splits=splits, out=out)
            err = _rel_err(out, expected) if not out.isnan().any() else float("nan")
            records.append(
                {
                    "kernel": "paged_attention",
                    "case": f"{name}/splits={splits or 'auto'}",
                    "rel_err": err,
                    "ok": err <= ATTN_TOL,
                }
            )

    gen = torch.Generator(device=device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        num_blocks, block, kv_heads, dim, tokens = 64, 16, 8, 128, 300
        cache_shape = (num_blocks, kv_heads, block, dim)
        slots = torch.randperm(num_blocks * block, device=device, generator=gen)[:tokens]
        slots[::7] = -1
        qkv = torch.randn(tokens, 3, kv_heads, dim, dtype=dtype, device=device, generator=gen)
        caches = [torch.full(cache_shape, float("nan"), dtype=dtype, device=device) for _ in range(2)]
        expected = [c.clone() for c in caches]
        reference.reshape_and_cache(qkv[:, 1], qkv[:, 2], *expected, slots)
        triton_ops.reshape_and_cache(qkv[:, 1], qkv[:, 2], *caches, slots)
        ok = all(
            torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) for a, b in zip(caches, expected, strict=True)
        )
        records.append(
            {"kernel": "reshape_and_cache", "case": str(dtype), "rel_err": 0.0 if ok else 1.0, "ok": ok}
        )

        layers = 4
        k_caches = [
            torch.randn(cache_shape, dtype=dtype, device=device, generator=gen) for _ in range(layers)
        ]
        v_caches = [
            torch.randn(cache_shape, dtype=dtype, device=device, generator=gen) for _ in range(layers)
        ]
        want_k, want_v = [c.clone() for c in k_caches], [c.clone() for c in v_caches]
        perm = torch.randperm(num_blocks, device=device, generator=gen)
        mapping = torch.stack([perm[:10], perm[10:20]], dim=1)
        reference.copy_blocks(want_k, want_v, mapping)
        triton_ops.copy_blocks(k_caches, v_caches, mapping)
        ok = all(torch.equal(a, b) for a, b in zip(k_caches + v_caches, want_k + want_v, strict=True))
        records.append({"kernel": "copy_blocks", "case": str(dtype), "rel_err": 0.0 if ok else 1.0, "ok": ok})
    return records


def measure_copy_bandwidth(device: torch.device) -> dict[str, float]:
    """Device-to-device copy of 1 GiB; bandwidth counts bytes read + bytes written."""
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))
    return {"bytes": nbytes, "ms": ms, "gb_per_s": 2 * nbytes / (ms * 1e-3) / 1e9}


def bench_decode(device: torch.device, batch: int, context: int, copy_gbps: float) -> dict[str, Any]:
    import torch.nn.functional as F

    from pagewise.kernels.triton_attention import launch_plan, paged_attention

    inputs = _paged_inputs(
        [context] * batch, [1] * batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device
    )
    args = _attention_args(inputs)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * 2
    plan = launch_plan(batch, batch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, context, device)
    out = torch.empty_like(inputs["query"])
    ms = _bench(lambda: paged_attention(*args, out=out))
    gbps = kv_bytes / (ms * 1e-3) / 1e9

    sweep = {}
    for splits in sorted({1, 2, 4, 8, 16, 32, plan.num_splits}):
        if splits * 256 <= context:
            sweep[str(splits)] = round(
                _bench(lambda s=splits: paged_attention(*args, num_splits=s, out=out)), 4
            )

    # The same K/V contiguous: [batch, kv_heads, context, dim]; queries [batch, heads, 1, dim].
    table = inputs["block_tables"].long()

    def contiguous(cache: torch.Tensor) -> torch.Tensor:
        blocks = cache[table]  # [batch, max_blocks, kv_heads, block_size, dim]
        return blocks.transpose(1, 2).reshape(batch, NUM_KV_HEADS, -1, HEAD_DIM)[:, :, :context].contiguous()

    k, v = contiguous(inputs["key_cache"]), contiguous(inputs["value_cache"])
    q = inputs["query"].view(batch, NUM_HEADS, 1, HEAD_DIM)
    try:
        sdpa_ms = _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
        sdpa_mode = "enable_gqa"
    except (RuntimeError, TypeError):  # no GQA support in this SDPA backend: expand heads (outside timing)
        group = NUM_HEADS // NUM_KV_HEADS
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        sdpa_ms = _bench(lambda: F.scaled_dot_product_attention(q, k, v))
        sdpa_mode = "expanded_kv"
    return {
        "batch": batch,
        "context": context,
        "num_splits": plan.num_splits,
        "ms": ms,
        "kv_bytes": kv_bytes,
        "gb_per_s": gbps,
        "fraction_of_copy_bw": gbps / copy_gbps,
        "sdpa_ms": sdpa_ms,
        "sdpa_mode": sdpa_mode,
        "ratio_vs_sdpa": ms / sdpa_ms,
        "meets_bw_target": gbps / copy_gbps >= BANDWIDTH_TARGET,
        "meets_sdpa_target": ms / sdpa_ms <= SDPA_TARGET,
        "split_sweep_ms": sweep,
    }


def bench_chunked_prefill(device: torch.device) -> dict[str, Any]:
    """8 sequences of 4,096 context, each with its last 256 tokens new (2,048 query tokens)."""
    from pagewise.kernels.triton_attention import paged_attention

    seqs, context, new = 8, 4096, 256
    inputs = _paged_inputs(
        [context] * seqs, [new] * seqs, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.bfloat16, device
    )
    args = _attention_args(inputs)
    out = torch.empty_like(inputs["query"])
    ms = _bench(lambda: paged_attention(*args, out=out))
    visible = seqs * sum(context - new + i + 1 for i in range(new))  # (query, key) pairs computed
    flops = 4 * visible * NUM_HEADS * HEAD_DIM
    return {
        "sequences": seqs,
        "context": context,
        "new_tokens": seqs * new,
        "ms": ms,
        "tflops": flops / ms / 1e9,
    }


def bench_cache_ops(device: torch.device) -> dict[str, Any]:
    from pagewise.kernels import triton_ops

    tokens, num_blocks = 8192, 4096
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=device)
    value = torch.randn_like(key)
    k_cache = torch.zeros(shape, dtype=torch.bfloat16, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[:tokens]
    write_ms = _bench(lambda: triton_ops.reshape_and_cache(key, value, k_cache, v_cache, slots))
    write_bytes = 2 * 2 * key.numel() * key.element_size()  # read + write, K and V

    layers, pairs = 16, 256
    k_caches = [torch.zeros((1024, *shape[1:]), dtype=torch.bfloat16, device=device) for _ in range(layers)]
    v_caches = [torch.zeros_like(c) for c in k_caches]
    perm = torch.randperm(1024, device=device)
    mapping = torch.stack([perm[:pairs], perm[pairs : 2 * pairs]], dim=1)
    copy_ms = _bench(lambda: triton_ops.copy_blocks(k_caches, v_caches, mapping))
    copy_bytes = 2 * 2 * layers * pairs * k_caches[0][0].numel() * 2
    return {
        "reshape_and_cache": {
            "tokens": tokens,
            "ms": write_ms,
            "gb_per_s": write_bytes / (write_ms * 1e-3) / 1e9,
        },
        "copy_blocks": {
            "layers": layers,
            "pairs": pairs,
            "ms": copy_ms,
            "gb_per_s": copy_bytes / (copy_ms * 1e-3) / 1e9,
        },
    }


LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def write_random_llama(path: Path, config: dict[str, Any], device: torch.device) -> int:
    """An HF-format directory (config.json, model.safetensors, word-level tokenizer.json) of random weights.

    Returns the parameter count.
    """
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    from pagewise.engine.loader import expected_weight_shapes
    from pagewise.engine.model_config import ModelArchConfig

    vocab = config["vocab_size"]
    shapes = expected_weight_shapes(ModelArchConfig.from_hf_config(config))
    gen = torch.Generator(device=device).manual_seed(0)
    tensors = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            w = torch.randn(shape, device=device, generator=gen, dtype=torch.bfloat16) * shape[-1] ** -0.5
            tensors[name] = w.cpu()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})

    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2"}))
    return sum(math.prod(s) for s in shapes.values())


def bench_engine(
    device: torch.device,
    config: dict[str, Any] = LLAMA_1B,
    num_prompts: int = 64,
    prompt_len: int = 512,
    max_tokens: int = 128,
    kv_cache_bytes: int = 16 << 30,
) -> dict[str, Any]:
    """Offline throughput of ``LLM.generate`` on a random-weight Llama-shaped model (token-id prompts).

    Times one ``generate`` of ``num_prompts`` random prompts (all submitted at once) after a small warm-up
    call that compiles the kernels; every request produces exactly ``max_tokens`` tokens (``ignore_eos``).
    """
    import inspect

    from pagewise import LLM, SamplingParams

    with tempfile.TemporaryDirectory(prefix="pagewise-bench-") as tmp:
        model_dir = Path(tmp) / "random-llama"
        t0 = time.perf_counter()
        params = write_random_llama(model_dir, config, device)
        write_s = time.perf_counter() - t0

        t0 = time.perf_counter()
        quiet = {"progress": False} if "progress" in inspect.signature(LLM).parameters else {}
        llm = LLM(
            model=str(model_dir),
            dtype="bfloat16",
            device=device.type,
            kv_cache_memory_bytes=kv_cache_bytes,
            **quiet,
        )
        load_s = time.perf_counter() - t0

        gen = torch.Generator().manual_seed(0)
        vocab = config["vocab_size"]
        prompts = [torch.randint(3, vocab, (prompt_len,), generator=gen).tolist() for _ in range(num_prompts)]
        sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        extra = {"use_tqdm": False} if "use_tqdm" in inspect.signature(llm.generate).parameters else {}

        t0 = time.perf_counter()
        warm = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
        llm.generate(prompts[:2], warm, **extra)
        warmup_s = time.perf_counter() - t0

        _sync(device)
        t0 = time.perf_counter()
        outputs = llm.generate(prompts, sampling, **extra)
        _sync(device)
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        del llm
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "params": params,
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "generated_tokens": generated,
        "seconds": elapsed,
        "output_tokens_per_s": generated / elapsed,
        "total_tokens_per_s": (generated + num_prompts * prompt_len) / elapsed,
        "write_weights_s": write_s,
        "load_s": load_s,
        "warmup_s": warmup_s,
    }


# ------------------------------------------------------------------------------------------------ main


def _section(results: dict[str, Any], name: str, fn: Callable[[], Any], log: Callable[[str], None]) -> None:
    t0 = time.perf_counter()
    log(f"[bench kernels] {name} ...")
    try:
        results[name] = fn()
    except Exception as error:  # a failing section is reported, the others still run
        results.setdefault("errors", {})[name] = f"{type(error).__name__}: {error}"
        log(traceback.format_exc())
    log(f"[bench kernels] {name} done in {time.perf_counter() - t0:.1f}s")


def _print_tables(results: dict[str, Any]) -> None:
    print(f"\npagewise kernel benchmark - {results['gpu']} - {results['date']}")
    print(f"torch {results['torch']}, triton {results['triton']}\n")
    if "correctness" in results:
        print(f"{'kernel':<20}{'case':<44}{'rel err':>10}  ok")
        for r in results["correctness"]:
            print(f"{r['kernel']:<20}{r['case']:<44}{r['rel_err']:>10.2e}  {'yes' if r['ok'] else 'NO'}")
        print()
    if "copy_bandwidth" in results:
        print(f"device-to-device copy bandwidth: {results['copy_bandwidth']['gb_per_s']:.0f} GB/s\n")
    if "decode" in results:
        header = (
            f"{'decode (bf16)':<22}{'splits':>7}{'ms':>9}{'GB/s':>8}{'% copy':>8}{'SDPA ms':>9}{'x SDPA':>8}"
        )
        print(header)
        for r in results["decode"]:
            label = f"{r['batch']} x {r['context']}"
            print(
                f"{label:<22}{r['num_splits']:>7}{r['ms']:>9.3f}{r['gb_per_s']:>8.0f}"
                f"{100 * r['fraction_of_copy_bw']:>7.0f}%{r['sdpa_ms']:>9.3f}{r['ratio_vs_sdpa']:>8.2f}"
            )
        for r in results["decode"]:
            sweep = ", ".join(f"{k}: {v:.3f}" for k, v in r["split_sweep_ms"].items())
            print(f"  split sweep {r['batch']} x {r['context']} (ms): {sweep}")
        print(f"  targets: >= {BANDWIDTH_TARGET:.0%} of copy bandwidth, <= {SDPA_TARGET}x SDPA time\n")
    if "chunked_prefill" in results:
        r = results["chunked_prefill"]
        print(
            f"chunked prefill: {r['new_tokens']} new tokens over {r['sequences']} x {r['context']} context: "
            f"{r['ms']:.3f} ms ({r['tflops']:.0f} TFLOP/s)\n"
        )
    if "cache_ops" in results:
        r = results["cache_ops"]
        w, c = r["reshape_and_cache"], r["copy_blocks"]
        print(f"reshape_and_cache {w['tokens']} tokens: {w['ms']:.3f} ms ({w['gb_per_s']:.0f} GB/s)")
        label = f"copy_blocks {c['pairs']} blocks x {c['layers']} layers"
        print(f"{label}: {c['ms']:.3f} ms ({c['gb_per_s']:.0f} GB/s)\n")
    if "engine" in results:
        r = results["engine"]
        print(
            f"engine ({r['params'] / 1e9:.2f}B params, bf16): {r['num_prompts']} prompts x {r['prompt_len']} "
            f"tokens -> {r['max_tokens']} tokens each: {r['seconds']:.2f} s, "
            f"{r['output_tokens_per_s']:.0f} output tok/s, {r['total_tokens_per_s']:.0f} total tok/s\n"
        )
    for name, error in results.get("errors", {}).items():
        print(f"FAILED {name}: {error}")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 if every correctness check passed and every section ran, else 1 (2: no CUDA)."""
    if not torch.cuda.is_available():
        print(
            "pagewise bench kernels needs a CUDA GPU (torch.cuda.is_available() is False).", file=sys.stderr
        )
        return ExitStatus.STARTUP_ERROR
    import triton

    device = torch.device("cuda")
    started = time.perf_counter()
    results: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(device),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    _section(results, "correctness", lambda: check_correctness(device), log)
    _section(results, "copy_bandwidth", lambda: measure_copy_bandwidth(device), log)
    copy_gbps = results.get("copy_bandwidth", {}).get("gb_per_s", float("nan"))
    _section(
        results, "decode", lambda: [bench_decode(device, b, c, copy_gbps) for b, c in DECODE_CONFIGS], log
    )
    _section(results, "chunked_prefill", lambda: bench_chunked_prefill(device), log)
    _section(results, "cache_ops", lambda: bench_cache_ops(device), log)
    if not getattr(args, "skip_engine", False):
        torch.cuda.empty_cache()
        _section(results, "engine", lambda: bench_engine(device), log)
    results["total_seconds"] = time.perf_counter() - started

    if getattr(args, "json", False):
        print(json.dumps(results, default=str))
    else:
        _print_tables(results)
    correct = all(r["ok"] for r in results.get("correctness", []))
    return ExitStatus.OK if correct and "errors" not in results else ExitStatus.FAILED
