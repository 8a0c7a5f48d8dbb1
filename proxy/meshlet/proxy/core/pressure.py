"""Load shedding (pure): which client connections the proxy drops when it holds too much.

Quiet is not hostile: no stream is cut for being quiet. The slow-peer defence acts under
pressure instead, on what an attack (slowloris, a trickled body, a reader that never reads)
costs: when the client connections, their streams in flight or the bytes buffered for them pass
a high-water mark, the connections that cost the most for the least progress are shed until
every total is back under its low-water mark.

Each served client connection is a `Peer`: the bytes it moved so far (either way), what it
holds now (streams in flight, bytes buffered for it), and how to shed it. `check(now)` ranks
them: connections younger than `grace` last (a new client has had no time to make progress),
then by the bytes they moved per second since the last `snapshot` (least first), then by what
they hold (most first). It sheds only peers that bring down a total that is over its mark.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Final, Protocol

_UNIT: Final = 64 * 1024  # buffered bytes that weigh as much as a stream in the ranking


class Resource(enum.Enum):
    CONNECTIONS = "connections"
    STREAMS = "streams"
    BUFFERED = "buffered_bytes"


@dataclass(frozen=True, slots=True)
class PressureLimits:
    """High-water marks; shedding brings each total down to `low_water` of its mark."""

    connections: int = 4096
    streams: int = 8192
    buffered: int = 128 * 1024 * 1024
    low_water: float = 0.9
    grace: float = 1.0  # seconds a new connection is shed only after every older one


class Peer(Protocol):
    def progress(self) -> int:
        """Bytes moved so far, either way."""

    def holds(self) -> tuple[int, int]:
        """(streams in flight, bytes buffered) now."""

    def shed(self, why: str) -> None:
        """Ends the connection (it is then `remove`d)."""


class _Seen:
    __slots__ = ("added", "at", "moved")

    def __init__(self, moved: int, now: float) -> None:
        self.added = now
        self.moved = moved  # progress at the last snapshot
        self.at = now  # ...taken then


@dataclass(frozen=True, slots=True)
class Shed:
    peer: Peer
    resource: Resource
    why: str


class Pressure:
    """The client connections one proxy serves, and the decision to shed some of them."""

    def __init__(self, limits: PressureLimits) -> None:
        self.limits = limits
        self._peers: dict[Peer, _Seen] = {}

    def __len__(self) -> int:
        return len(self._peers)

    def add(self, peer: Peer, now: float) -> None:
        self._peers[peer] = _Seen(peer.progress(), now)

    def remove(self, peer: Peer) -> None:
        self._peers.pop(peer, None)

    def crowded(self) -> bool:
        """More connections than the mark (checked at each accept: `check` then sheds)."""
        return len(self._peers) > self.limits.connections

    def snapshot(self, now: float) -> None:
        """Starts a new measuring period for every peer's rate of progress."""
        for peer, seen in self._peers.items():
            seen.moved, seen.at = peer.progress(), now

    def check(self, now: float) -> list[Shed]:
        """The peers to shed now, in order (nothing when every total is under its mark)."""
        limits = self.limits
        held = {peer: peer.holds() for peer in self._peers}
        totals = {
            Resource.CONNECTIONS: len(held),
            Resource.STREAMS: sum(streams for streams, _ in held.values()),
            Resource.BUFFERED: sum(buffered for _, buffered in held.values()),
        }
        marks = {
            Resource.CONNECTIONS: limits.connections,
            Resource.STREAMS: limits.streams,
            Resource.BUFFERED: limits.buffered,
        }
        over = {r for r in Resource if totals[r] > marks[r]}
        if not over:
            return []
        lows = {r: int(marks[r] * limits.low_water) for r in Resource}

        def rank(peer: Peer) -> tuple[bool, float, int]:
            seen = self._peers[peer]
            elapsed = max(now - seen.at, 1e-3)
            rate = (peer.progress() - seen.moved) / elapsed
            streams, buffered = held[peer]
            return now - seen.added < limits.grace, rate, -(streams + buffered // _UNIT)

        shed: list[Shed] = []
        for peer in sorted(self._peers, key=rank):
            streams, buffered = held[peer]
            gives = {
                Resource.CONNECTIONS: 1,
                Resource.STREAMS: streams,
                Resource.BUFFERED: buffered,
            }
            helped = [r for r in Resource if r in over and gives[r] > 0]
            if not helped:
                continue
            for resource in Resource:
                totals[resource] -= gives[resource]
            why = ", ".join(f"{r.value} {totals[r] + gives[r]} over {marks[r]}" for r in helped)
            shed.append(Shed(peer, helped[0], f"the proxy is over its {why}"))
            over = {r for r in over if totals[r] > lows[r]}
            if not over:
                break
        return shed
