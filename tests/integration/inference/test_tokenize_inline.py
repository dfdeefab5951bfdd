"""Small work is rendered and tokenized on the event loop, larger work on a thread, both giving the same token
ids; the work's size counts the messages the template renders, not only their text, and a chat request's
messages and content parts are capped before anything is rendered."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pagewise.platform.bodies import parse_body
from pagewise.platform.errors import APIError
from pagewise.platform.inference.prompts import (
    INLINE_TOKENIZE_CHARS,
    MESSAGE_WORK_CHARS,
    prepare_chat,
    prepare_completion,
)
from pagewise.platform.inference.schemas import (
    MAX_CONTENT_PARTS,
    MAX_MESSAGES,
    ChatCompletionRequest,
    CompletionRequest,
)
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.quota_store import QuotaLimits

from ..harness import MODEL, Platform

pytestmark = pytest.mark.anyio
PRINCIPAL = Principal(
    key_id="k", tenant_id="t", tenant_name="t", scopes=("inference",), limits=QuotaLimits(),
    max_tokens_per_request=None, max_n=None, weight=1.0,
)


def record_threads(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the threads the engine client's encoders run on, in call order."""
    threads: list[str] = []
    for name in ("encode", "encode_chat"):
        real = getattr(engine, name)

        def recording(*args: Any, _real: Any = real) -> Any:
            threads.append(threading.current_thread().name)
            return _real(*args)

        monkeypatch.setattr(engine, name, recording)
    return threads


CHAT_INLINE_CHARS = INLINE_TOKENIZE_CHARS - MESSAGE_WORK_CHARS  # one message's text that still renders inline


@pytest.mark.parametrize("chars", [40, CHAT_INLINE_CHARS, CHAT_INLINE_CHARS + 1, INLINE_TOKENIZE_CHARS + 1, 1500])
async def test_where_text_is_tokenized(platform: Platform, monkeypatch: pytest.MonkeyPatch, chars: int) -> None:
    engine = platform.services.engine
    threads = record_threads(engine, monkeypatch)
    text = ("word " * chars)[:chars]
    messages = [{"role": "user", "content": text}]
    chat_body = parse_body({"model": MODEL, "messages": messages}, ChatCompletionRequest)
    chat = await prepare_chat(chat_body, PRINCIPAL, engine)
    completion_body = parse_body({"model": MODEL, "prompt": text}, CompletionRequest)
    completion = await prepare_completion(completion_body, PRINCIPAL, engine)
    on_loop = [name == threading.current_thread().name for name in threads]
    assert on_loop == [chars <= CHAT_INLINE_CHARS, chars <= INLINE_TOKENIZE_CHARS]
    tokenizer = engine.transport.tokenizer()
    assert completion.prompts == [tokenizer.encode(text)]
    assert chat.prompts == [tokenizer.apply_chat_template(messages, add_generation_prompt=True)]


async def test_many_empty_messages_are_rendered_off_the_loop(platform: Platform, monkeypatch) -> None:
    """No text at all, but a template to run per message: the work is counted by messages too."""
    engine = platform.services.engine
    threads = record_threads(engine, monkeypatch)
    body = parse_body({"model": MODEL, "messages": [{"role": "user", "content": ""}] * 40}, ChatCompletionRequest)
    await prepare_chat(body, PRINCIPAL, engine)
    assert threads and threads[0] != threading.current_thread().name


@pytest.mark.parametrize(
    ("messages", "fragment"),
    [
        ([{"role": "user", "content": ""}] * (MAX_MESSAGES + 1), f"at most {MAX_MESSAGES:,} per request"),
        (
            [{"role": "user", "content": [{"type": "text", "text": ""}] * 8}] * (MAX_CONTENT_PARTS // 8 + 1),
            f"at most {MAX_CONTENT_PARTS:,} per request",
        ),
    ],
)
async def test_message_and_part_counts_are_capped_before_rendering(
    platform: Platform, monkeypatch, messages: list, fragment: str
) -> None:
    engine = platform.services.engine
    threads = record_threads(engine, monkeypatch)
    body = parse_body({"model": MODEL, "messages": messages}, ChatCompletionRequest)
    with pytest.raises(APIError) as raised:
        await prepare_chat(body, PRINCIPAL, engine)
    assert (raised.value.status_code, raised.value.param) == (400, "messages")
    assert fragment in raised.value.message and threads == []  # refused before anything was rendered
