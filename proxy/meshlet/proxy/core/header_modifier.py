"""A route's header modification (the Gateway API's RequestHeaderModifier, and the same shape for
ResponseHeaderModifier), compiled once when a policy arrives and applied to a head's fields.

A modifier's lists apply in Linkerd's order: `add` appends a value to those the header has, `set`
replaces all its values with one, `remove` deletes it; names compare case-insensitively. Each
operation is "drop these names, then append these fields", and so is any sequence of them: a
rule's filters compile into one `HeaderModifier`, and applying it is one pass over the fields
and an append, whatever the engine (HTTP/1 rewrites its serialized head with it, HTTP/2 its
header list). Names are kept lower case (HTTP/2 requires it; HTTP/1 does not care).

Compiling refuses what `meshlet.api.headers` refuses (ValueError saying why): no modifier can
write or remove the client identity the proxy vouches for, its error headers, a pseudo-header or
a field that frames the message; no value carries CR, LF or NUL.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from meshlet.api.headers import name_problem, value_problem

Header = tuple[bytes, bytes]


@dataclass(frozen=True, slots=True)
class HeaderModifier:
    """Drops every field named in `drop` (lower case), then appends `append`."""

    drop: frozenset[bytes] = frozenset()
    append: tuple[Header, ...] = ()

    def then(self, after: HeaderModifier) -> HeaderModifier:
        """This modification followed by `after`, as one."""
        kept = tuple(field for field in self.append if field[0] not in after.drop)
        return HeaderModifier(self.drop | after.drop, kept + after.append)

    def apply(self, fields: Iterable[Header]) -> list[Header]:
        """The fields, modified (their order kept; the appended ones last)."""
        drop = self.drop
        out = [f for f in fields if f[0].lower() not in drop] if drop else list(fields)
        out += self.append
        return out


NOTHING = HeaderModifier()


def compile_modifier(
    add: Iterable[tuple[str, bytes]] = (),
    set: Iterable[tuple[str, bytes]] = (),
    remove: Iterable[str] = (),
) -> HeaderModifier:
    """One RequestHeaderModifier's (or ResponseHeaderModifier's) lists, compiled; ValueError
    naming the first name or value refused."""
    out = NOTHING
    for name, value in add:
        out = out.then(HeaderModifier(append=((_name(name), _value(name, value)),)))
    for name, value in set:
        key = _name(name)
        out = out.then(HeaderModifier(frozenset((key,)), ((key, _value(name, value)),)))
    names = frozenset(_name(name) for name in remove)
    return out.then(HeaderModifier(names)) if names else out


def _name(name: str) -> bytes:
    problem = name_problem(name)
    if problem is not None:
        raise ValueError(problem)
    return name.lower().encode("ascii")


def _value(name: str, value: bytes) -> bytes:
    problem = value_problem(value)
    if problem is not None:
        raise ValueError(f"header {name[:64]!r}: {problem}")
    return value
