"""Failed-authentication throttling: per address and per key prefix, fixed windows, a 429 with Retry-After."""

from __future__ import annotations

import pytest

from pagewise.platform.errors import APIError
from pagewise.platform.keys import auth_throttle
from pagewise.platform.keys.auth_throttle import MAX_PER_ADDRESS, MAX_PER_PREFIX, WINDOW_S, FailedAuthThrottle


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_an_address_is_refused_after_its_failures_until_the_window_ends() -> None:
    clock = Clock(10 * WINDOW_S + 15)
    throttle = FailedAuthThrottle(clock)
    for i in range(MAX_PER_ADDRESS):
        throttle.check("10.0.0.1", f"p{i}")
        throttle.failed("10.0.0.1", f"p{i}")
    with pytest.raises(APIError) as refused:
        throttle.check("10.0.0.1", "fresh")
    error = refused.value
    assert (error.status_code, error.headers["Retry-After"]) == (429, "45")
    assert error.code == "too_many_failed_authentications"
    assert "from this address" in error.message
    throttle.check("10.0.0.2", "fresh")  # another address is not slowed
    clock.now += 45  # the next window
    throttle.check("10.0.0.1", "fresh")


def test_a_prefix_is_refused_after_its_failures_from_any_address() -> None:
    throttle = FailedAuthThrottle(Clock(0.0))
    for i in range(MAX_PER_PREFIX):
        throttle.failed(f"10.0.0.{i}", "abc123")
    with pytest.raises(APIError, match="for this API key"):
        throttle.check("192.168.0.1", "abc123")
    throttle.check("192.168.0.1", "other")


def test_tracked_entries_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth_throttle, "MAX_TRACKED", 4)
    throttle = FailedAuthThrottle(Clock(0.0))
    for i in range(MAX_PER_ADDRESS):
        throttle.failed(f"a{i}", f"p{i}")
    assert len(throttle._failures) == 5  # four tracked, one overflow
    with pytest.raises(APIError):  # untracked addresses share the overflow count
        throttle.check("never-seen", "never-seen")
