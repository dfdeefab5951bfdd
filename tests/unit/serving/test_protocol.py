"""Every protocol message survives the wire unchanged, and a malformed one is refused, not half-decoded."""

from __future__ import annotations

import msgspec
import pytest

from pagewise.engine.sampling_params import SamplingParams
from pagewise.serving.protocol import (
    ChoiceDelta,
    Delta,
    ErrorCode,
    ErrorInfo,
    Finished,
    PositionLogprobs,
    Rejected,
    Reservation,
    Submit,
    TokenLogprob,
    Usage,
    decode_event,
    decode_submit,
    encode,
)


def _submit(**params: object) -> Submit:
    return Submit(
        request_id="cmpl_1", tenant_id="ten_1", model="m", endpoint="completions", prompts=[[1, 2, 3], [4]],
        params=SamplingParams(n=2, seed=5, stop=["x"], logit_bias={7: -1.5}, **params),
        reservation=Reservation("cmpl_1", "ten_1", 40, 29_000_000, "2026-12", slots=4),
        tenant_weight=2.0, traceparent="00-" + "1" * 32 + "-" + "2" * 16 + "-01",
    )


def test_submit_round_trips() -> None:
    submit = _submit(max_tokens=9)
    decoded = decode_submit(encode(submit))
    assert decoded == submit and decoded.params.stop_strings == ("x",) and decoded.params.logit_bias == {7: -1.5}


@pytest.mark.parametrize(
    "event",
    [
        Delta(attempt=2, prompt_tokens=5, cached_tokens=3, choices=[
            ChoiceDelta(3, "hi", [9], "stop", [PositionLogprobs(TokenLogprob(9, "hi", -0.1), [])]),
        ]),
        Finished(
            status="completed",
            usage=Usage(prompt_tokens=5, completion_tokens=7, cached_tokens=3),
            finished_at=1.5,
            started_at=1.0,
            first_token_at=1.2,
        ),
        Finished(status="failed", usage=Usage(), error=ErrorInfo(ErrorCode.WORKER_LOST, "gone"), finished_at=2.0),
        Rejected(error=ErrorInfo(ErrorCode.INVALID_REQUEST, "bad", "max_tokens")),
    ],
)
def test_events_round_trip_as_one_tagged_union(event: object) -> None:
    assert decode_event(encode(event)) == event


def test_sampling_params_are_validated_on_decode() -> None:
    """A Submit carrying parameters the engine would refuse never decodes into a Submit."""
    raw = msgspec.msgpack.decode(encode(_submit()))
    raw["params"]["temperature"] = -1.0
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        decode_submit(msgspec.msgpack.encode(raw))


def test_an_unknown_event_is_refused() -> None:
    with pytest.raises(msgspec.ValidationError):
        decode_event(msgspec.msgpack.encode({"type": "surprise"}))
