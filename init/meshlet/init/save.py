"""`iptables-save` output read back (pure): one table's chains and rules.

Counters, `#` comments and policies are dropped; rules keep the exact text iptables prints, which
is the text `Rule.render()` produces for ours.
"""

from __future__ import annotations

import itertools
import shlex


def parse_save(text: str, table: str = "nat") -> dict[str, list[str]]:
    """Chain name → its rules (`-A CHAIN ...` lines), in the order printed; {} when `table` is
    not in `text`. ValueError on a line iptables-save does not print."""
    chains: dict[str, list[str]] = {}
    inside = False
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            inside = line[1:] == table
        elif not inside:
            continue
        elif line == "COMMIT":
            inside = False
        elif line.startswith(":"):
            chains.setdefault(line[1:].split()[0], [])
        elif line.startswith("-A "):
            chains.setdefault(line.split()[1], []).append(line)
        else:
            raise ValueError(f"unexpected line in iptables-save output: {line!r}")
    return chains


def target(rule: str) -> str | None:
    """What `rule` jumps (-j) or goes (-g) to; None when it has no target."""
    words = shlex.split(rule)
    for flag, value in itertools.pairwise(words):
        if flag in ("-j", "--jump", "-g", "--goto"):
            return value
    return None
