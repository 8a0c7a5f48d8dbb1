"""The tap controller's bounds: how many taps run at once, and how many requests per second one
tap passes on. Pure: `now` comes in, decisions go out.

A tap is rated by requests (`req` events), as `linkerd viz tap --max-rps` is: a request that is
let through brings its `rsp` and `end` with it, a request that is dropped takes them along, so a
reader never sees half a request. How many were dropped is counted, never hidden."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final

MAX_OPEN_REQUESTS: Final = 10_000  # request ids remembered per tap until their `end`


class TapSlots:
    """A cap on concurrent taps."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> str | None:
        """None when admitted, else why not."""
        if self.active >= self.limit:
            return f"the tap controller runs its maximum of {self.limit} concurrent taps"
        self.active += 1
        return None

    def release(self) -> None:
        self.active = max(0, self.active - 1)


@dataclass(slots=True)
class RequestRate:
    """A token bucket of `per_second` requests, holding at most one second's worth."""

    per_second: float
    tokens: float = field(init=False)
    last: float | None = field(default=None, init=False)
    dropped: int = field(default=0, init=False)
    _open: OrderedDict[tuple[str, int, int], None] = field(default_factory=OrderedDict, init=False)

    def __post_init__(self) -> None:
        self.tokens = self.per_second

    def request(self, key: tuple[str, int, int], now: float) -> bool:
        """Whether the request `key` (proxy, base, stream) passes at `now`."""
        if self.last is not None:
            self.tokens = min(self.per_second, self.tokens + (now - self.last) * self.per_second)
        self.last = now
        if self.tokens < 1.0:
            self.dropped += 1
            return False
        self.tokens -= 1.0
        self._open[key] = None
        if len(self._open) > MAX_OPEN_REQUESTS:
            self._open.popitem(last=False)
        return True

    def follows(self, key: tuple[str, int, int], *, end: bool) -> bool:
        """Whether a `rsp` (end=False) or `end` (end=True) of request `key` passes: only when
        its request did."""
        if key not in self._open:
            return False
        if end:
            del self._open[key]
        return True

    def take_dropped(self) -> int:
        """Requests dropped since the last call."""
        dropped, self.dropped = self.dropped, 0
        return dropped
