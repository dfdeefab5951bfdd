"""Failed-authentication throttling: a flood of wrong keys is refused before it reaches the database.

Invariants:
- Only failures that cost a key lookup count (a well-formed key whose prefix is unknown or whose secret does not
  match); a missing or malformed key is refused without one, so it is not worth counting.
- Windows are fixed (`WINDOW_S`): within one, an address may fail `MAX_PER_ADDRESS` times and a key prefix
  `MAX_PER_PREFIX` times (someone guessing the secret of a known key); past that, every attempt from that
  address or for that prefix — right or wrong — is a 429 with `Retry-After` (the rest of the window) and no
  lookup. Good keys from other addresses and for other prefixes are not slowed: the check is two dict reads.
- The counts are this replica's own (each API replica throttles what it sees); memory is bounded by
  `MAX_TRACKED` entries per window, after which new addresses and prefixes share one overflow count.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from pagewise.platform.errors import APIError

WINDOW_S = 60.0
MAX_PER_ADDRESS = 30
MAX_PER_PREFIX = 10
MAX_TRACKED = 100_000
_OVERFLOW = ("overflow", "")


class FailedAuthThrottle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._window = -1
        self._failures: dict[tuple[str, str], int] = {}

    def _roll(self) -> float:
        """Start a fresh window when the clock has left the current one; the seconds left in it."""
        now = self._clock()
        window = math.floor(now / WINDOW_S)
        if window != self._window:
            self._window, self._failures = window, {}
        return (window + 1) * WINDOW_S - now

    def _count(self, kind: str, value: str) -> int:
        count = self._failures.get((kind, value))
        if count is None:
            return self._failures.get(_OVERFLOW, 0) if len(self._failures) >= MAX_TRACKED else 0
        return count

    def check(self, address: str, prefix: str) -> None:
        """Raise the 429 if `address` or `prefix` has failed too often in this window."""
        left = self._roll()
        address_over = self._count("address", address) >= MAX_PER_ADDRESS
        if address_over or self._count("prefix", prefix) >= MAX_PER_PREFIX:
            whom = "from this address" if address_over else "for this API key"
            raise APIError(
                429,
                f"Too many failed authentications {whom}; retry in {math.ceil(left)} s",
                type="rate_limit_error",
                code="too_many_failed_authentications",
                headers={"Retry-After": str(math.ceil(left))},
            )

    def failed(self, address: str, prefix: str) -> None:
        """Count one failed lookup against `address` and `prefix`."""
        self._roll()
        for entry in (("address", address), ("prefix", prefix)):
            if entry not in self._failures and len(self._failures) >= MAX_TRACKED:
                entry = _OVERFLOW
            self._failures[entry] = self._failures.get(entry, 0) + 1
