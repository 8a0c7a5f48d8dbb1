"""Abuse accounting for one HTTP/2 connection: rapid resets, control-frame and empty-frame floods.

Pure: the engine reports what the peer did, with a clock reading `now`, and closes the connection
with GOAWAY ENHANCE_YOUR_CALM when a report returns a reason. Counts cover a sliding window
(two fixed buckets, the older one weighted by how much of it is still inside the window), so a
long-lived connection is judged on its recent behaviour only.

- Rapid reset (CVE-2023-44487): what the attack does is reset streams before the upstream
  could answer them, at a high rate, as a high share of the connection's streams. The engine
  reports those only: streams the client reset less than a round trip to the upstream after
  their request arrived (`early`: the attack's resets come at once), and streams the proxy
  refused or reset for their malformed input. The guard trips once there are `min_resets` of
  them in the window and they are more than `reset_ratio` of the streams opened.
  Cancellations that come later (a gRPC deadline, a client giving up on a long poll) are not
  reported: they cost what any request costs, and are legitimate traffic.
- Control frames (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, empty DATA, unknown frames) cost work
  and earn nothing: allowed `control_base` per window plus `control_per_unit` per useful unit
  (a stream opened or a DATA frame sent to the peer, which legitimately draws WINDOW_UPDATEs).
- Empty DATA frames without END_STREAM: at most `max_empty_run` in a row.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GuardLimits:
    window: float = 10.0  # seconds
    min_resets: int = 100
    reset_ratio: float = 0.5
    control_base: int = 1000
    control_per_unit: int = 4
    max_empty_run: int = 32
    # Unsent bytes queued for a peer that is not reading (PING/SETTINGS ACKs pile up there).
    max_write_buffer: int = 1 << 20


class Guard:
    """Counts one connection's streams, resets and control frames over a sliding window."""

    __slots__ = (
        "_cur",
        "_empty_run",
        "_prev",
        "_start",
        "limits",
    )

    # Counter slots in `_cur` / `_prev`.
    _OPENED, _RESETS, _CONTROL, _USEFUL = range(4)

    def __init__(self, limits: GuardLimits, now: float) -> None:
        self.limits = limits
        self._start = now
        self._cur = [0, 0, 0, 0]
        self._prev = [0, 0, 0, 0]
        self._empty_run = 0

    def _roll(self, now: float) -> float:
        """Moves the buckets forward to `now`; returns the weight of the previous bucket."""
        window = self.limits.window
        elapsed = now - self._start
        if elapsed >= window:
            if elapsed >= 2 * window:
                self._prev = [0, 0, 0, 0]
            else:
                self._prev = self._cur
            self._cur = [0, 0, 0, 0]
            self._start = now - elapsed % window
            elapsed = now - self._start
        return 1.0 - elapsed / window

    def _estimate(self, slot: int, weight: float) -> float:
        return self._prev[slot] * weight + self._cur[slot]

    def stream_opened(self) -> None:
        self._cur[self._OPENED] += 1
        self._cur[self._USEFUL] += 1
        self._empty_run = 0

    def data_sent(self, frames: int) -> None:
        self._cur[self._USEFUL] += frames

    def stream_reset(self, now: float) -> str | None:
        """A stream ended by RST_STREAM before it finished, sent by either side."""
        weight = self._roll(now)
        self._cur[self._RESETS] += 1
        resets = self._estimate(self._RESETS, weight)
        if resets < self.limits.min_resets:
            return None
        if resets > self.limits.reset_ratio * self._estimate(self._OPENED, weight):
            return f"rapid reset: {resets:.0f} streams reset in {self.limits.window:g}s"
        return None

    def control_frame(self, now: float) -> str | None:
        weight = self._roll(now)
        self._cur[self._CONTROL] += 1
        control = self._estimate(self._CONTROL, weight)
        allowed = self.limits.control_base + self.limits.control_per_unit * self._estimate(
            self._USEFUL, weight
        )
        if control > allowed:
            return f"control frame flood: {control:.0f} in {self.limits.window:g}s"
        return None

    def data_frame(self, empty: bool) -> str | None:
        """A DATA frame received; `empty`: no payload and no END_STREAM."""
        if not empty:
            self._empty_run = 0
            return None
        self._empty_run += 1
        if self._empty_run > self.limits.max_empty_run:
            return f"empty frame flood: {self._empty_run} empty DATA frames in a row"
        return None

    def write_buffer(self, size: int) -> str | None:
        if size > self.limits.max_write_buffer:
            return f"peer not reading: {size} bytes queued"
        return None
