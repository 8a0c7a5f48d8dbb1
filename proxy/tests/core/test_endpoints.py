"""The stream rules of `EndpointSet`."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.endpoints import (
    Add,
    DiscoveredEndpoint,
    EndpointSet,
    Hint,
    NoEndpoints,
    Remove,
    Status,
    TlsIdentity,
    Update,
)

WEB_ID = "web.emojivoto.serviceaccount.identity.meshlet.cluster.local"


def ep(n: int) -> DiscoveredEndpoint:
    return DiscoveredEndpoint((f"10.0.0.{n}", 8080), 10000, (), None, None, None)


def test_a_stream_transcript() -> None:
    s = EndpointSet()
    assert s.status is Status.PENDING
    s = s.apply(NoEndpoints(False), first=True)
    assert s.status is Status.UNKNOWN
    s = s.apply(NoEndpoints(True))
    assert s.status is Status.EMPTY
    s = s.apply(Add((ep(1), ep(2))))
    assert s.status is Status.READY and set(s.endpoints) == {ep(1).addr, ep(2).addr}
    s = s.apply(Remove((ep(1).addr,)))
    assert list(s.endpoints) == [ep(2).addr]
    s = s.apply(Remove((ep(2).addr,)))
    assert s.status is Status.EMPTY  # the server then says no_endpoints{exists: true}
    assert s.version == 5  # one per update


def test_a_changed_endpoint_replaces_the_old_one() -> None:
    moved = DiscoveredEndpoint(ep(1).addr, 5000, (("zone", "b"),), None, None, None)
    s = EndpointSet().apply(Add((ep(1),)), first=True).apply(Add((moved,)))
    assert dict(s.endpoints) == {ep(1).addr: moved}


def test_after_a_reconnect_the_first_message_replaces_never_merges() -> None:
    before = EndpointSet().apply(Add((ep(1), ep(2))), first=True)
    assert set(before.apply(Add((ep(3),)), first=True).endpoints) == {ep(3).addr}
    emptied = before.apply(NoEndpoints(True), first=True)
    assert emptied.status is Status.EMPTY and not emptied.endpoints
    assert before.apply(Remove((ep(1).addr,)), first=True).endpoints == {}


def test_replaced_starts_pending_and_keeps_counting() -> None:
    s = EndpointSet().apply(Add((ep(1),)), first=True)
    fresh = s.replaced()
    assert fresh.status is Status.PENDING and not fresh.endpoints
    assert fresh.version == s.version + 1


endpoints_st = st.builds(
    DiscoveredEndpoint,
    addr=st.tuples(st.sampled_from([f"10.0.0.{i}" for i in range(1, 6)]), st.just(8080)),
    weight=st.sampled_from([1, 10000]),
    labels=st.just(()),
    identity=st.none() | st.just(TlsIdentity(WEB_ID, WEB_ID)),
    hint=st.none() | st.sampled_from(Hint),
    opaque_transport_port=st.none() | st.just(4143),
)
updates_st: st.SearchStrategy[Update] = st.one_of(
    st.builds(Add, st.lists(endpoints_st, max_size=4).map(tuple)),
    st.builds(Remove, st.lists(endpoints_st.map(lambda e: e.addr), max_size=3).map(tuple)),
    st.builds(NoEndpoints, st.booleans()),
)
streams_st = st.lists(st.tuples(updates_st, st.booleans()), max_size=30)


def build(history: list[tuple[Update, bool]]) -> EndpointSet:
    s = EndpointSet()
    for update, first in history:
        s = s.apply(update, first=first)
    return s


@given(streams_st)
def test_matches_a_plain_dict_model(history: list[tuple[Update, bool]]) -> None:
    model: dict[tuple[str, int], DiscoveredEndpoint] = {}
    exists: bool | None = None
    for update, first in history:
        if first:
            model, exists = {}, None
        if isinstance(update, Add):
            model.update((e.addr, e) for e in update.endpoints)
            exists = True
        elif isinstance(update, Remove):
            for a in update.addrs:
                model.pop(a, None)
            exists = True if exists is None else exists
        else:
            model, exists = {}, update.exists
    s = build(history)
    assert dict(s.endpoints) == model
    assert s.exists == exists
    assert s.version == len(history)


@given(streams_st, updates_st)
def test_the_first_message_of_a_stream_forgets_every_earlier_stream(
    history: list[tuple[Update, bool]], update: Update
) -> None:
    assert build(history).apply(update, first=True) == EndpointSet().apply(update, first=True)


@given(streams_st, updates_st)
def test_applying_an_update_twice_is_applying_it_once(
    history: list[tuple[Update, bool]], update: Update
) -> None:
    once = build(history).apply(update)
    assert once.apply(update) == once


@given(streams_st)
def test_versions_only_grow(history: list[tuple[Update, bool]]) -> None:
    s = EndpointSet()
    for update, first in history:
        nxt = s.apply(update, first=first)
        assert nxt.version == s.version + 1
        s = nxt
