"""How an execution hands its events to the transport: each delta as soon as it is computed, except the one that
finishes the request, which travels with the terminal event (one delivery after the final write, not two)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from pagewise.protocol import Delta, Event, Finished, Submit

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


async def _batches(platform: Platform, monkeypatch: pytest.MonkeyPatch, max_tokens: int) -> list[list[Event]]:
    """The batches the engine side emitted for one completion of `max_tokens` tokens (EOS ignored)."""
    host = platform.services.engine.transport.host
    real_run, batches = host.run, []

    def recording_run(submit: Submit, emit: Any, **kw: Any) -> Any:
        async def recording_emit(events: Sequence[Event]) -> None:
            batches.append(list(events))
            await emit(events)

        return real_run(submit, recording_emit, **kw)

    monkeypatch.setattr(host, "run", recording_run)
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": max_tokens, "ignore_eos": True}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    return batches


async def test_every_delta_goes_at_once_but_the_last_which_goes_with_the_end(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = await _batches(platform, monkeypatch, max_tokens=3)
    kinds = [[type(event).__name__ for event in batch] for batch in batches]
    assert kinds == [["Delta"], ["Delta"], ["Delta", "Finished"]]
    first, held = batches[0][0], batches[-1][0]
    assert isinstance(first, Delta) and first.engine_ttft_s is not None and first.engine_ttft_s > 0
    # the held delta waited for the final write, so it carries no time to first token (the queue hop would grow)
    assert isinstance(held, Delta) and held.engine_ttft_s is None
    assert isinstance(batches[-1][1], Finished) and batches[-1][1].status == "completed"
    assert sum(len(c.token_ids) for batch in batches for e in batch if isinstance(e, Delta) for c in e.choices) == 3


async def test_a_request_done_at_its_first_token_is_one_delivery(
    platform: Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    batches = await _batches(platform, monkeypatch, max_tokens=1)
    assert [[type(event).__name__ for event in batch] for batch in batches] == [["Delta", "Finished"]]
