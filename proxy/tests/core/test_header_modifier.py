"""A route's header modification: add appends, set replaces, remove deletes, in that order, names
compared whatever their case; the proxy's own headers, pseudo-headers and framing are refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.proxy.core.header_modifier import NOTHING, HeaderModifier, compile_modifier

HEAD = [
    (b":path", b"/items"),
    (b"Accept", b"text/html"),
    (b"X-Tenant", b"blue"),
    (b"x-tenant", b"green"),
    (b"meshlet-client-id", b"web.shop.serviceaccount.identity.meshlet.cluster.local"),
]


def test_add_appends_a_value_and_keeps_those_the_header_has() -> None:
    modifier = compile_modifier(add=[("X-Tenant", b"red"), ("x-trace", b"1")])
    assert modifier.apply(HEAD) == [*HEAD, (b"x-tenant", b"red"), (b"x-trace", b"1")]


def test_set_replaces_every_value_whatever_the_case() -> None:
    modifier = compile_modifier(set=[("X-TENANT", b"red"), ("accept", b"*/*")])
    assert modifier.apply(HEAD) == [
        (b":path", b"/items"),
        HEAD[4],
        (b"x-tenant", b"red"),
        (b"accept", b"*/*"),
    ]


def test_remove_deletes_every_value_whatever_the_case() -> None:
    assert compile_modifier(remove=["x-TENANT", "absent"]).apply(HEAD) == [
        HEAD[0], HEAD[1], HEAD[4],
    ]  # fmt: skip


def test_the_order_is_add_then_set_then_remove() -> None:
    """Set overrides what add appended, remove takes away what set wrote."""
    modifier = compile_modifier(
        add=[("x-a", b"added"), ("x-b", b"added"), ("x-c", b"added")],
        set=[("x-b", b"set"), ("x-c", b"set")],
        remove=["x-c"],
    )
    assert modifier.apply([(b"x-a", b"had"), (b"x-b", b"had"), (b"x-c", b"had")]) == [
        (b"x-a", b"had"), (b"x-a", b"added"), (b"x-b", b"set"),
    ]  # fmt: skip


def test_several_values_and_repeated_names() -> None:
    """Two adds of one name both arrive, in order; of two sets of one name the last wins."""
    modifier = compile_modifier(
        add=[("x-a", b"1"), ("X-A", b"2")], set=[("x-b", b"first"), ("x-b", b"last")]
    )
    assert modifier.apply([]) == [(b"x-a", b"1"), (b"x-a", b"2"), (b"x-b", b"last")]


def test_a_rules_filters_compose_in_order() -> None:
    first = compile_modifier(add=[("x-a", b"1")], set=[("x-b", b"1")])
    second = compile_modifier(set=[("x-a", b"2")], remove=["x-b"])
    assert first.then(second).apply([(b"x-b", b"0")]) == [(b"x-a", b"2")]
    assert second.then(first).apply([(b"x-b", b"0")]) == [(b"x-a", b"2"), (b"x-a", b"1"),
                                                           (b"x-b", b"1")]  # fmt: skip


def test_an_empty_filter_changes_nothing() -> None:
    assert compile_modifier() == NOTHING
    assert NOTHING.apply(HEAD) == HEAD


@pytest.mark.parametrize(
    "name",
    [
        "meshlet-client-id", "Meshlet-Client-Id", "l5d-client-id", "meshlet-proxy-error",
        "l5d-proxy-error", "l5d-dst-canonical", "meshlet-anything",
        ":authority", ":path", ":method", "host", "Host", "content-length", "transfer-encoding",
        "connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade",
        "http2-settings",
        "", "x tenant", "x-tenant:", "x\r\ny", "x-tënant", "x" * 257,
    ],
)  # fmt: skip
def test_names_the_proxy_owns_or_that_are_not_names_are_refused_in_every_list(name: str) -> None:
    for lists in ({"add": [(name, b"v")]}, {"set": [(name, b"v")]}, {"remove": [name]}):
        with pytest.raises(ValueError, match=r"reserved|pseudo-header|frames|not a valid|empty|"
                                             r"longer"):  # fmt: skip
            compile_modifier(**lists)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "value",
    [b"a\r\nx-injected: 1", b"a\nb", b"a\rb", b"a\x00b", b"a\x7fb", b"\x01", b" padded",
     b"padded\t", b"x" * 4097],
)  # fmt: skip
def test_values_with_control_characters_or_surrounding_space_are_refused(value: bytes) -> None:
    for lists in ({"add": [("x-a", value)]}, {"set": [("x-a", value)]}):
        with pytest.raises(ValueError, match="'x-a'"):
            compile_modifier(**lists)  # type: ignore[arg-type]


def test_values_may_hold_inner_spaces_tabs_and_non_ascii_bytes() -> None:
    value = "a b\tc é".encode()
    assert compile_modifier(set=[("x-a", value)]).apply([]) == [(b"x-a", value)]


_names = st.sampled_from(["x-a", "X-A", "x-b", "x-c"])
_values = st.sampled_from([b"1", b"2", b"3"])
_pairs = st.lists(st.tuples(_names, _values), max_size=4)
_fields = st.lists(st.tuples(st.sampled_from([b"x-a", b"X-B", b"y"]), _values), max_size=4)
Fields = list[tuple[bytes, bytes]]


def _reference(
    fields: Fields, add: list[tuple[str, bytes]], set_: list[tuple[str, bytes]], remove: list[str]
) -> Fields:
    """The filter applied step by step, as the Gateway API words it."""
    out = list(fields)
    for name, value in add:
        out.append((name.lower().encode(), value))
    for name, value in set_:
        key = name.lower().encode()
        out = [f for f in out if f[0].lower() != key] + [(key, value)]
    gone = {n.lower().encode() for n in remove}
    return [f for f in out if f[0].lower() not in gone]


@given(_pairs, _pairs, st.lists(_names, max_size=3), _fields)
def test_the_compiled_modifier_does_what_each_step_does_in_turn(
    add: list[tuple[str, bytes]],
    set_: list[tuple[str, bytes]],
    remove: list[str],
    fields: Fields,
) -> None:
    compiled = compile_modifier(add, set_, remove)
    assert compiled.apply(fields) == _reference(fields, add, set_, remove)
    assert isinstance(compiled, HeaderModifier)
