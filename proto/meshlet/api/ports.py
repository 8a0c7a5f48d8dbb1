"""Port lists with ranges (`25, 587,4000-4010`): the one grammar for every setting that names ports.

`parse_ports` reads the text of a flag, an environment variable or an annotation into
`PortRanges`, a value of inclusive ranges in the order written. Every bad item is named in one
`ValueError`, so a user fixes a list in one go. Renderings for other tools (iptables' `4000:4010`)
belong to their users, not here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Final

MIN_PORT: Final = 1
MAX_PORT: Final = 65535

# ASCII digits only (str.isdigit also accepts "²" and "٣"), at most five of them, so that a
# hostile list never reaches int() with thousands of digits.
_ITEM = re.compile(r"([0-9]{1,5})(?:\s*-\s*([0-9]{1,5}))?")


@dataclass(frozen=True, slots=True, order=True)
class PortRange:
    """`first` to `last`, both included; a single port has first == last."""

    first: int
    last: int

    def __post_init__(self) -> None:
        if not MIN_PORT <= self.first <= self.last <= MAX_PORT:
            raise ValueError(f"{self.first}-{self.last} is not a range within 1-65535")

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.first <= port <= self.last

    def __str__(self) -> str:
        return str(self.first) if self.first == self.last else f"{self.first}-{self.last}"


@dataclass(frozen=True, slots=True)
class PortRanges:
    """A list of port ranges, in the order written, without repeated items."""

    ranges: tuple[PortRange, ...] = ()

    @classmethod
    def of(cls, ports: Iterable[int]) -> PortRanges:
        """Single ports, sorted (e.g. a frozenset of defaults)."""
        return cls(tuple(PortRange(p, p) for p in sorted(set(ports))))

    def contains(self, port: int) -> bool:
        return any(port in r for r in self.ranges)

    def __contains__(self, port: object) -> bool:
        return isinstance(port, int) and self.contains(port)

    def union(self, other: PortRanges) -> PortRanges:
        """`self`'s ranges, then those of `other` that `self` does not list already."""
        return PortRanges(tuple(dict.fromkeys((*self.ranges, *other.ranges))))

    def __iter__(self) -> Iterator[PortRange]:
        return iter(self.ranges)

    def __len__(self) -> int:
        return len(self.ranges)

    def __bool__(self) -> bool:
        return bool(self.ranges)

    def __str__(self) -> str:
        """The list as it is written in a flag (`25,587,4000-4010`); parses back to itself."""
        return ",".join(str(r) for r in self.ranges)


def parse_ports(text: str) -> PortRanges:
    """`"25, 587,4000-4010"` → PortRanges of 25, 587 and 4000-4010. Empty items are ignored;
    ValueError names every bad item."""
    ranges, errors = scan_ports(text)
    if errors:
        raise ValueError("; ".join(errors))
    return ranges


def scan_ports(text: str) -> tuple[PortRanges, tuple[str, ...]]:
    """The good items of `text` and a description of each bad one, for readers that must not
    refuse a whole list (an annotation a cluster already holds)."""
    ranges: list[PortRange] = []
    errors: list[str] = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            continue
        match = _ITEM.fullmatch(item)
        if match is None:
            errors.append(f"{item!r} is not a port or a range (e.g. 25 or 4000-4010)")
            continue
        first = int(match[1])
        last = int(match[2]) if match[2] is not None else first
        if not (MIN_PORT <= first <= MAX_PORT and MIN_PORT <= last <= MAX_PORT):
            errors.append(f"{item!r} is outside {MIN_PORT}-{MAX_PORT}")
        elif first > last:
            errors.append(f"{item!r} is a reversed range (write {last}-{first})")
        else:
            ranges.append(PortRange(first, last))
    return PortRanges(tuple(dict.fromkeys(ranges))), tuple(errors)
