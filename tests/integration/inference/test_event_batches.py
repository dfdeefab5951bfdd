"""Every delta reaches the transport before the request's final write, and the terminal event after it: a worker
killed between the two leaves a redelivery only the row's `Finished` to re-send, and the client already has
every token (the distributed e2e test kills a worker mid-flight and compares every text)."""

from __future__ import annotations

from typing import Any

import pytest

from pagewise.serving.protocol import Delta, Event, Finished, Submit

from ..harness import MODEL, Platform, bearer

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("max_tokens", [1, 3])
async def test_deltas_go_before_the_final_write_and_the_end_after(
    platform: Platform, monkeypatch: pytest.MonkeyPatch, max_tokens: int
) -> None:
    host = platform.services.engine.transport.host
    real_run, real_finish, log = host.run, host.requests.finish, []

    def recording_run(submit: Submit, emit: Any, **kw: Any) -> Any:
        async def recording_emit(event: Event) -> None:
            log.append(type(event).__name__)
            await emit(event)

        return real_run(submit, recording_emit, **kw)

    async def recording_finish(*args: Any, **kwargs: Any) -> Any:
        settled = await real_finish(*args, **kwargs)
        log.append("final write")
        return settled

    monkeypatch.setattr(host, "run", recording_run)
    monkeypatch.setattr(host.requests, "finish", recording_finish)
    _, key = await platform.tenant_with_key()
    body = {"model": MODEL, "prompt": "Count: one, two,", "max_tokens": max_tokens, "ignore_eos": True}
    response = await platform.http.post("/v1/completions", json=body, headers=bearer(key))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    assert log == [Delta.__name__] * max_tokens + ["final write", Finished.__name__]
