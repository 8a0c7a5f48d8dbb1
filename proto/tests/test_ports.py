"""The port-list grammar: examples, every error named at once, and properties over any list."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from meshlet.api.ports import PortRange, PortRanges, parse_ports


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", ()),
        (" , ,", ()),
        ("25", ((25, 25),)),
        ("25, 587,4000-4010", ((25, 25), (587, 587), (4000, 4010))),
        ("4000 - 4010", ((4000, 4010),)),
        ("7-7", ((7, 7),)),
        ("1-65535", ((1, 65535),)),
        ("443,25,443", ((443, 443), (25, 25))),  # order kept, repeats dropped
        ("0025", ((25, 25),)),
    ],
)
def test_parse(text: str, expected: tuple[tuple[int, int], ...]) -> None:
    assert parse_ports(text) == PortRanges(tuple(PortRange(a, b) for a, b in expected))


def test_every_bad_item_is_named_in_one_error() -> None:
    with pytest.raises(ValueError) as error:
        parse_ports("0,x,9-3,80,70000,1-70000,²,-5,5-,123456,4000:4010")
    message = str(error.value)
    for item in ("'0' is outside", "'x' is not a port", "'9-3' is a reversed range (write 3-9)",
                 "'70000' is outside", "'1-70000' is outside", "'²' is not a port",
                 "'-5' is not a port", "'5-' is not a port", "'123456' is not a port",
                 "'4000:4010' is not a port"):  # fmt: skip
        assert item in message
    assert message.count("; ") == 9  # ten bad items named, the good 80 not blamed


def test_contains_and_text() -> None:
    ports = parse_ports("25,587,4000-4010")
    assert [p for p in (24, 25, 26, 587, 3999, 4000, 4005, 4010, 4011) if ports.contains(p)] == [
        25, 587, 4000, 4005, 4010,
    ]  # fmt: skip
    assert str(ports) == "25,587,4000-4010"
    assert len(ports) == 3 and bool(ports) and not PortRanges()
    assert [str(r) for r in ports] == ["25", "587", "4000-4010"]


def test_union_keeps_order_without_repeats() -> None:
    fixed = parse_ports("4190,4191")
    assert str(fixed.union(parse_ports("22,4191,8000-8080"))) == "4190,4191,22,8000-8080"


def test_a_range_outside_the_ports_cannot_be_built() -> None:
    with pytest.raises(ValueError):
        PortRange(0, 5)
    with pytest.raises(ValueError):
        PortRange(9, 3)


ports = st.integers(min_value=1, max_value=65535)
ranges = st.tuples(ports, ports).map(lambda t: PortRange(min(t), max(t)))
spaces = st.sampled_from(["", " ", "  ", "\t"])


@st.composite
def written(draw: st.DrawFn) -> tuple[list[PortRange], str]:
    """Ranges and one way a person could write them (spaces, single ports, empty items)."""
    items = draw(st.lists(ranges, max_size=20))
    text = ",".join(
        draw(spaces)
        + (str(r.first) if r.first == r.last and draw(st.booleans()) else f"{r.first}-{r.last}")
        + draw(spaces)
        for r in items
    )
    if draw(st.booleans()):
        text += ","
    return items, text


@given(written())
def test_any_written_list_parses_to_its_ranges(case: tuple[list[PortRange], str]) -> None:
    items, text = case
    assert parse_ports(text).ranges == tuple(dict.fromkeys(items))


@given(st.lists(ranges, max_size=20))
def test_text_parses_back_to_itself(items: list[PortRange]) -> None:
    value = PortRanges(tuple(dict.fromkeys(items)))
    assert parse_ports(str(value)) == value


@given(st.lists(ranges, max_size=8), st.lists(ports, max_size=20))
def test_contains_agrees_with_the_set_of_ports(items: list[PortRange], probes: list[int]) -> None:
    value = PortRanges(tuple(dict.fromkeys(items)))
    every = {p for r in items for p in range(r.first, r.last + 1)}
    for port in (*probes, 0, 1, 65535, 65536, *(r.first for r in items), *(r.last for r in items)):
        assert value.contains(port) == (port in every)


junk = st.text(alphabet=st.characters(exclude_characters=","), min_size=1, max_size=12).filter(
    lambda s: s.strip() and not re.fullmatch(r"\s*[0-9]{1,5}(\s*-\s*[0-9]{1,5})?\s*", s)
)


@given(st.lists(ranges, max_size=5), st.lists(junk, min_size=1, max_size=5), st.randoms())
def test_every_bad_item_is_named(good: list[PortRange], bad: list[str], rng: random.Random) -> None:
    items = [str(r) for r in good] + bad
    rng.shuffle(items)
    with pytest.raises(ValueError) as error:
        parse_ports(",".join(items))
    for item in bad:
        assert repr(item.strip()) in str(error.value)


@given(st.text(max_size=200))
def test_hostile_text_parses_or_raises_value_error(text: str) -> None:
    try:
        value = parse_ports(text)
    except ValueError:
        return
    assert parse_ports(str(value)) == value
