"""Short text is tokenized on the event loop, long text on a thread; both give the same token ids."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from pagewise.platform.bodies import parse_body
from pagewise.platform.inference.prompts import INLINE_TOKENIZE_CHARS, prepare_chat, prepare_completion
from pagewise.platform.inference.schemas import ChatCompletionRequest, CompletionRequest
from pagewise.platform.keys.auth import Principal
from pagewise.platform.quotas.quota_store import QuotaLimits

from ..harness import MODEL, Platform

pytestmark = pytest.mark.anyio
PRINCIPAL = Principal(
    key_id="k", tenant_id="t", tenant_name="t", scopes=("inference",), limits=QuotaLimits(),
    max_tokens_per_request=None, max_n=None, weight=1.0,
)


@pytest.mark.parametrize("chars", [40, INLINE_TOKENIZE_CHARS, INLINE_TOKENIZE_CHARS + 1, 1500])
async def test_where_text_is_tokenized(platform: Platform, monkeypatch: pytest.MonkeyPatch, chars: int) -> None:
    engine = platform.services.engine
    threads: list[str] = []
    for name in ("encode", "encode_chat"):
        real = getattr(engine, name)

        def recording(*args: Any, _real: Any = real) -> Any:
            threads.append(threading.current_thread().name)
            return _real(*args)

        monkeypatch.setattr(engine, name, recording)
    text = ("word " * chars)[:chars]
    messages = [{"role": "user", "content": text}]
    chat_body = parse_body({"model": MODEL, "messages": messages}, ChatCompletionRequest)
    chat = await prepare_chat(chat_body, PRINCIPAL, engine)
    completion_body = parse_body({"model": MODEL, "prompt": text}, CompletionRequest)
    completion = await prepare_completion(completion_body, PRINCIPAL, engine)
    inline = chars <= INLINE_TOKENIZE_CHARS
    assert [name == threading.current_thread().name for name in threads] == [inline, inline]
    tokenizer = engine.transport.tokenizer()
    assert completion.prompts == [tokenizer.encode(text)]
    assert chat.prompts == [tokenizer.apply_chat_template(messages, add_generation_prompt=True)]
