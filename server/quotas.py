"""Per-client quotas (the key file's max_concurrent and chars_per_minute, server/auth.py): a client over its own quota
is refused at once with RESOURCE_EXHAUSTED and a retry-after, before any work, and the engines' capacity stays
for everyone else. The engines' queue bound (--max-queue) still holds for all clients together.

- max_concurrent: translation calls of the client in flight at once; one more is refused, retry after a second.
- chars_per_minute: source characters a minute, a token bucket (Envoy's rate limits: a bucket that holds
  one minute's worth, refilled continuously); a call whose characters the bucket does not hold is refused,
  retry after the time the bucket takes to hold them. A call larger than one minute's worth can never pass and
  says so, without a retry-after.

All of it runs on the server's event loop (both fronts), so the state needs no lock. A client's state outlives
reloads of the key file; its bucket starts again full when its limits change."""

from __future__ import annotations

import math
import time

from nmtserve.errors import NmtserveError

CONCURRENCY_RETRY_SECONDS = 1  # a slot is free again when one of the client's calls ends: about a call's time


class QuotaExceeded(NmtserveError):
    """A client's call over its quota (RESOURCE_EXHAUSTED); retry_after: whole seconds until it would pass, None
    when it never would."""

    def __init__(self, message: str, quota: str, retry_after: int | None):
        super().__init__(message)
        self.quota, self.retry_after = quota, retry_after


class ClientQuota:
    """One client's calls in flight and bucket of characters."""

    def __init__(self, name: str, clock=time.monotonic):
        self.name, self.clock, self.in_flight = name, clock, 0
        self.max_concurrent: int | None = None
        self.chars_per_minute: int | None = None
        self.tokens, self.filled = 0.0, clock()

    def limit(self, max_concurrent: int | None, chars_per_minute: int | None) -> None:
        """Set the limits; a bucket of new size starts full."""
        self.max_concurrent = max_concurrent
        if chars_per_minute != self.chars_per_minute:
            self.chars_per_minute, self.tokens, self.filled = chars_per_minute, float(chars_per_minute or 0), self.clock()

    def enter(self) -> None:
        """One more call in flight, or QuotaExceeded."""
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            raise QuotaExceeded(f"client {self.name}: at its quota of {self.max_concurrent} call(s) in flight at once",
                                "concurrency", CONCURRENCY_RETRY_SECONDS)
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1

    def charge(self, chars: int) -> None:
        """Take a call's characters from the bucket, or QuotaExceeded."""
        capacity = self.chars_per_minute
        if capacity is None:
            return
        if chars > capacity:
            raise QuotaExceeded(f"client {self.name}: {chars} characters in one call, more than its quota of "
                                f"{capacity} a minute ever allows: split the text", "characters", None)
        now = self.clock()
        rate = capacity / 60.0
        self.tokens, self.filled = min(capacity, self.tokens + (now - self.filled) * rate), now
        if chars > self.tokens:
            wait = math.ceil((chars - self.tokens) / rate)
            raise QuotaExceeded(f"client {self.name}: {chars} characters, over its quota of {capacity} a minute; "
                                f"retry in {wait} s", "characters", wait)
        self.tokens -= chars

    def refund(self, chars: int) -> None:
        """Give back what charge took for a call the server then refused (a full queue)."""
        if self.chars_per_minute is not None:
            self.tokens = min(self.chars_per_minute, self.tokens + chars)


class Quotas:
    """Every client's quota state, by name."""

    def __init__(self):
        self._clients: dict[str, ClientQuota] = {}

    def of(self, name: str, max_concurrent: int | None, chars_per_minute: int | None) -> ClientQuota:
        """The client's state, under the limits the key file gives it now."""
        quota = self._clients.get(name)
        if quota is None:
            quota = self._clients[name] = ClientQuota(name)
        quota.limit(max_concurrent, chars_per_minute)
        return quota
