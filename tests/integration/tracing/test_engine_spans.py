"""The engine's detail in a request's trace, on a tiny random model whose KV cache holds 16 blocks of 4 tokens and
whose steps compute at most 8 tokens: a prompt's prefill is one span per chunk after its queue wait, and
concurrent requests that do not fit are preempted — by recompute, or by swap where it can — each preemption an
event of its request's trace with its resumption after it, counted on the execution span. Several prompts of one
request get a queue wait each and share its decode span."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterator

import pytest
import torch
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import format_trace_id

from pagewise.engine.async_engine import AsyncLLMEngine
from pagewise.engine.config import EngineConfig
from pagewise.engine.model_runner import KVCache
from pagewise.platform.db.migrate import upgrade_head
from pagewise.platform.tracing import TRACE_ID_HEADER

from ..harness import Platform, bearer

pytestmark = pytest.mark.anyio
BLOCK, NUM_BLOCKS, BUDGET = 4, 16, 8
PROMPT_TOKENS, MAX_TOKENS, CONCURRENT = 20, 16, 4  # each needs 9 of the 16 blocks at its end


@pytest.fixture(scope="module")
def database_url(fresh_database: Callable[[str], str]) -> str:
    """Overrides the session's: one SQLite database is enough here (the spans do not depend on the database)."""
    url = fresh_database("sqlite")
    upgrade_head(url)
    return url


@pytest.fixture(scope="module", params=["recompute", "swap"])
def llm_engine(request: pytest.FixtureRequest, tiny_model: Callable) -> Iterator[AsyncLLMEngine]:
    """Overrides the session's engine for the `platform` app: a tiny one that must preempt."""
    path, model = tiny_model("tracing-tiny-kv")
    cfg = model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_block = KVCache.bytes_per_block(cfg.num_hidden_layers, BLOCK, cfg.num_key_value_heads, head_dim, torch.float32)
    config = EngineConfig(
        model=str(path),
        block_size=BLOCK,
        kv_cache_memory_bytes=NUM_BLOCKS * per_block,
        max_num_batched_tokens=BUDGET,
        max_model_len=128,
        preemption_mode=request.param, dtype="float32"
    )
    engine = AsyncLLMEngine(config, progress=False)
    yield engine
    engine.shutdown()


async def _complete(platform: Platform, key: str, model: str, seed: int) -> tuple[str, dict]:
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 49152) for _ in range(PROMPT_TOKENS)]
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    return response.headers[TRACE_ID_HEADER], response.json()


async def _engine_spans(spans: InMemorySpanExporter, trace_id: str) -> dict[str, list[ReadableSpan]]:
    """The trace's engine-side spans by name, once its execution span has ended."""
    for _ in range(100):
        by_name: dict[str, list[ReadableSpan]] = {}
        for span in spans.get_finished_spans():
            if format_trace_id(span.context.trace_id) == trace_id:
                by_name.setdefault(span.name, []).append(span)
        if "pagewise.execute" in by_name:
            return by_name
        await asyncio.sleep(0.05)
    raise AssertionError(f"trace {trace_id} has no execution span")


def _preemption_events(by_name: dict[str, list[ReadableSpan]]) -> list[Event]:
    spans = by_name["pagewise.execute"] + by_name.get("pagewise.decode", [])
    found = [e for span in spans for e in span.events if e.name in ("pagewise.preempted", "pagewise.resumed")]
    return sorted(found, key=lambda e: e.timestamp)


async def test_a_chunked_prefill_is_a_queue_wait_then_one_span_per_chunk(
    platform: Platform, spans: InMemorySpanExporter, llm_engine: AsyncLLMEngine
) -> None:
    _, key = await platform.tenant_with_key()
    trace_id, _ = await _complete(platform, key, llm_engine.model_name, seed=1)
    by_name = await _engine_spans(spans, trace_id)
    [schedule], [decode] = by_name["pagewise.schedule"], by_name["pagewise.decode"]
    chunks = sorted(by_name["pagewise.prefill"], key=lambda s: s.start_time)
    assert [c.attributes["pagewise.prefill.tokens"] for c in chunks] == [8, 8, 4]  # the step budget, then the rest
    steps = [c.attributes["pagewise.engine.step"] for c in chunks]
    assert steps == list(range(steps[0], steps[0] + 3)) and schedule.attributes["pagewise.engine.step"] == steps[0]
    assert schedule.attributes["pagewise.kv.blocks"] == 2 and schedule.attributes["pagewise.cached_tokens"] == 0
    assert schedule.end_time == chunks[0].start_time and chunks[-1].end_time == decode.start_time
    assert all(a.end_time <= b.start_time for a, b in zip(chunks, chunks[1:], strict=False))
    assert not any(c.attributes["pagewise.prefill.recompute"] for c in chunks)
    assert [e.name for e in decode.events] == ["gen_ai.first_token"]
    assert decode.events[0].timestamp == decode.start_time
    assert by_name["pagewise.execute"][0].attributes["pagewise.preemptions"] == 0


async def test_each_preemption_is_an_event_with_its_resumption_and_counted_on_the_execution(
    platform: Platform, spans: InMemorySpanExporter, llm_engine: AsyncLLMEngine
) -> None:
    mode = llm_engine.config.preemption_mode
    _, key = await platform.tenant_with_key()
    before = llm_engine.stats()["num_preemptions"]
    results = await asyncio.gather(
        *(_complete(platform, key, llm_engine.model_name, seed=10 + i) for i in range(CONCURRENT))
    )
    preemptions = llm_engine.stats()["num_preemptions"] - before
    assert preemptions > 0
    counted, modes, recomputed = 0, set(), False
    for trace_id, body in results:
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
        by_name = await _engine_spans(spans, trace_id)
        [execute], [decode] = by_name["pagewise.execute"], by_name["pagewise.decode"]
        events = _preemption_events(by_name)
        preempted = [e for e in events if e.name == "pagewise.preempted"]
        resumed = [e for e in events if e.name == "pagewise.resumed"]
        assert execute.attributes["pagewise.preemptions"] == len(preempted) == len(resumed)
        assert [e.name for e in events] == ["pagewise.preempted", "pagewise.resumed"] * len(preempted)  # paired
        for out, back in zip(preempted, resumed, strict=True):
            assert out.attributes["pagewise.preemption.mode"] == back.attributes["pagewise.preemption.mode"]
            assert out.attributes["pagewise.engine.step"] < back.attributes["pagewise.engine.step"]
            if back.attributes["pagewise.preemption.mode"] == "swap":
                assert back.attributes["pagewise.cached_tokens"] == 0
        for event in decode.events[1:]:
            assert event.timestamp >= decode.start_time  # on the decode span: after the first token
        for event in execute.events:
            assert event.timestamp < decode.start_time  # on the execution span: before it
        chunks = by_name["pagewise.prefill"]
        tokens = [(c.attributes["pagewise.prefill.tokens"], c.attributes["pagewise.prefill.recompute"]) for c in chunks]
        assert all(0 < n <= BUDGET for n, _ in tokens)
        assert sum(n for n, again in tokens if not again) >= PROMPT_TOKENS  # more if preempted within the prompt
        recomputed |= any(again for _, again in tokens)
        counted += len(preempted)
        modes |= {e.attributes["pagewise.preemption.mode"] for e in preempted}
    assert counted == preemptions  # every preemption of the engine is in one of the traces
    if mode == "recompute":
        assert modes == {"recompute"} and recomputed
    else:
        assert "swap" in modes  # a victim still in its prefill cannot be swapped: it is recomputed


async def test_several_prompts_and_samples_get_a_queue_wait_each_and_share_one_decode_span(
    platform: Platform, spans: InMemorySpanExporter, llm_engine: AsyncLLMEngine
) -> None:
    _, key = await platform.tenant_with_key()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 49152) for _ in range(PROMPT_TOKENS)] for _ in range(2)]
    body = {"model": llm_engine.model_name, "prompt": prompts, "max_tokens": 6, "n": 2, "temperature": 0}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    by_name = await _engine_spans(spans, response.headers[TRACE_ID_HEADER])
    assert sorted(s.attributes["pagewise.prompt.index"] for s in by_name["pagewise.schedule"]) == [0, 1]
    assert len(by_name["pagewise.decode"]) == 1
    fresh: dict[int, int] = {}
    for chunk in by_name["pagewise.prefill"]:
        prompt, choice = chunk.attributes["pagewise.prompt.index"], chunk.attributes["pagewise.choice.index"]
        assert choice // 2 == prompt  # choices are numbered prompt by prompt, as in the response
        if not chunk.attributes["pagewise.prefill.recompute"]:
            assert choice % 2 == 0  # a prompt's second sample forks from its first: no prefill of its own
            fresh[prompt] = fresh.get(prompt, 0) + chunk.attributes["pagewise.prefill.tokens"]
    assert sorted(fresh) == [0, 1] and min(fresh.values()) >= PROMPT_TOKENS
    [execute] = by_name["pagewise.execute"]
    assert execute.attributes["pagewise.preemptions"] == sum(
        e.name == "pagewise.preempted" for e in _preemption_events(by_name)
    )
