"""Load shedding: under its marks nothing is shed; over one, the connections that cost most for
the least progress go first, until every total is back under its low-water mark."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.pressure import Pressure, PressureLimits, Resource


@dataclass(eq=False)
class Conn:
    name: str
    moved: int = 0
    streams: int = 0
    buffered: int = 0
    shed_for: list[str] = field(default_factory=list)

    def progress(self) -> int:
        return self.moved

    def holds(self) -> tuple[int, int]:
        return self.streams, self.buffered

    def shed(self, why: str) -> None:
        self.shed_for.append(why)


def pressure(conns: list[Conn], limits: PressureLimits, at: float = 0.0) -> Pressure:
    p = Pressure(limits)
    for conn in conns:
        p.add(conn, at)
    return p


def test_nothing_is_shed_under_the_marks() -> None:
    conns = [Conn(f"c{i}", streams=1, buffered=1000) for i in range(10)]
    p = pressure(conns, PressureLimits(connections=10, streams=10, buffered=10_000))
    assert not p.crowded()
    assert p.check(now=100.0) == []


def test_over_the_connections_the_least_progress_goes_first_down_to_low_water() -> None:
    busy = [Conn(f"busy{i}") for i in range(6)]
    idle = [Conn(f"idle{i}") for i in range(4)]  # a slowloris, a forgotten keep-alive
    p = pressure([*busy, *idle], PressureLimits(connections=8, low_water=0.75))
    for conn in busy:
        conn.moved += 50_000  # bytes since the snapshot at 0
    assert p.crowded()
    shed = p.check(now=10.0)
    assert [s.peer for s in shed] == idle[:4]  # 10 → 6 = 75 % of 8
    assert {s.resource for s in shed} == {Resource.CONNECTIONS}
    assert shed[0].why == "the proxy is over its connections 10 over 8"


def test_a_trickle_ranks_after_silence_and_before_real_traffic() -> None:
    silent, trickle, busy = Conn("silent"), Conn("trickle"), Conn("busy")
    p = pressure([silent, trickle, busy], PressureLimits(connections=2, low_water=0.5))
    trickle.moved, busy.moved = 10, 1_000_000
    assert [s.peer for s in p.check(now=10.0)] == [silent, trickle]


def test_new_connections_are_shed_only_after_every_older_one() -> None:
    old = [Conn(f"old{i}", moved=0) for i in range(3)]
    p = pressure(old, PressureLimits(connections=3, low_water=0.67, grace=1.0), at=0.0)
    for conn in old:
        conn.moved = 10**9  # busy
    new = Conn("new")
    p.add(new, 9.9)  # no time yet to make progress
    assert [s.peer for s in p.check(now=10.0)] == [old[0], old[1]]


def test_over_the_streams_only_connections_holding_streams_help() -> None:
    quiet_many = Conn("quiet-many", streams=50)
    quiet_none = Conn("quiet-none")  # holds no stream: shedding it would not help
    busy = Conn("busy", streams=60, moved=0)
    p = pressure([quiet_many, quiet_none, busy], PressureLimits(streams=100, low_water=0.9))
    busy.moved = 10**6
    shed = p.check(now=5.0)
    assert [s.peer for s in shed] == [quiet_many]
    assert shed[0].resource is Resource.STREAMS


def test_over_the_buffered_bytes_the_biggest_holder_among_the_slowest_goes() -> None:
    small = Conn("small", buffered=1 << 20)
    big = Conn("big", buffered=100 << 20)  # a reader that does not read: the proxy holds it all
    p = pressure([small, big], PressureLimits(buffered=64 << 20))
    shed = p.check(now=5.0)
    assert [s.peer for s in shed] == [big] and shed[0].resource is Resource.BUFFERED


def test_progress_is_measured_from_the_last_snapshot() -> None:
    early, late = Conn("early"), Conn("late")
    p = pressure([early, late], PressureLimits(connections=1, low_water=1.0))
    early.moved = 10**6  # busy long ago
    p.snapshot(10.0)
    late.moved = 1000  # busy since
    assert [s.peer for s in p.check(now=20.0)] == [early]


@given(
    st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 20), st.integers(0, 1 << 22)),
        max_size=40,
    ),
    st.integers(1, 30),
    st.integers(1, 200),
    st.integers(1, 1 << 24),
)
def test_shedding_brings_every_total_under_its_low_mark_or_sheds_all_that_helps(
    specs: list[tuple[int, int, int]], connections: int, streams: int, buffered: int
) -> None:
    limits = PressureLimits(connections, streams, buffered, low_water=0.9, grace=0.0)
    conns = [Conn(f"c{i}", 0, s, b) for i, (_, s, b) in enumerate(specs)]
    p = pressure(conns, limits)
    for conn, (moved, _, _) in zip(conns, specs, strict=True):
        conn.moved = moved
    shed = p.check(now=1.0)
    victims = [s.peer for s in shed]
    assert len(set(map(id, victims))) == len(victims)
    kept = [c for c in conns if all(c is not v for v in victims)]
    totals = (len(kept), sum(c.streams for c in kept), sum(c.buffered for c in kept))
    marks = (connections, streams, buffered)
    was_over = [
        total > mark
        for total, mark in zip((len(conns), sum(c.streams for c in conns),
                                sum(c.buffered for c in conns)), marks, strict=True)
    ]  # fmt: skip
    if not any(was_over):
        assert victims == []
    for i, (total, mark) in enumerate(zip(totals, marks, strict=True)):
        if was_over[i] and total > int(mark * 0.9):  # still over: nothing left that helps
            left = [(1, c.streams, c.buffered)[i] for c in kept]
            assert not any(left)
