"""Small helpers shared by the ``pagewise bench`` subcommands: progress lines, tables, engine stepping."""

from __future__ import annotations

import random
import sys
import time


def progress(message: str) -> None:
    """One progress line on stderr (stdout carries only the result: a table, or one JSON object)."""
    print(message, file=sys.stderr, flush=True)


def print_table(rows: list[tuple[str, object]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        if isinstance(value, float):
            text = f"{value:.3f}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            text = f"{value:,}"
        else:
            text = str(value)
        print(f"{name:<{width}}  {text:>14}")


def random_tokens(count: int, vocab_size: int, rng: random.Random) -> list[int]:
    """Random token ids, avoiding the lowest ids (special tokens in the Llama-family vocabularies we ship)."""
    return [rng.randrange(3, vocab_size) for _ in range(count)]


def blocks_in_use(engine) -> int:
    stats = engine.stats()
    return stats["kv_blocks_total"] - stats["kv_blocks_free"]


def add_model_arg(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name, HF directory or GGUF file")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes, for smoke tests")


class Timer:
    def __init__(self) -> None:
        self.start = time.perf_counter()

    def __str__(self) -> str:
        return f"{time.perf_counter() - self.start:.1f} s"
